"""A replica's prefill speed, measured once at start-up on its own weights,
threads and kernels: the line admission's speed model starts from
(pdcluster/planning/speed.py), before the gateway has measured any first
token of its own.

The configured default (`autoscaling.speed`) is one machine's 1-thread
replica.  On the 2-core AMD EPYC (avx512_bf16) class the default layout's
2-thread colocated replica prefilled 256-token prompts about 2.4x faster
than that line says, and the gateway's calibration moves slowly from its
prior: of 16 simultaneous 256-token prompts the first burst after start
admitted 4, where 8-9 made the 1.6 s bound (0.8 x the TTFT SLO) with
shedding off (2026-12-05, docs/operating.md).  A replica on a slower class
is slower than the default line, and the same measurement keeps admission
from promising what it cannot serve.

How: a scratch engine on the same loaded weights (a small KV pool of its
own, no prefix cache, no tiers, no speculation; nothing of the serving
engine is touched: its counters, cache and KV events stay as they were)
prefills one prompt of PROFILE_TOKENS tokens, alone, REPEATS times after
one untimed warm-up; the fastest time over the prompt's tokens is the
per-token time admission adopts (its per-step overhead stays the
configured one).  One prompt in the step sizes the replica's scheduler
takes, so chunking costs what it costs in service.  0.4-0.8 s of one
replica's start on this machine.

Saved with the model cache: the first measurement for a GGUF model is
written beside its converted weights (pdcluster/services/model_cache.py),
named by everything that sets the speed (weights and KV dtypes, threads,
block and step sizes, the native kernel build, the CPU model and count);
a later start with the same key -- a respawn after a crash, a scale-up,
the next `pdcluster up` -- reads it instead of measuring again.  Only a
measurement that had the cores is saved (MIN_CPU_SHARE_TO_SAVE: this
process's CPU time over the runs' wall time x threads): one taken beside a
busy neighbour, which reads slow, serves its own start and is not kept.  The
gateway's online calibration takes over from either at its first measured
first token."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

from pdcluster.planning.speed import PrefillModel
from pdcluster.services.engine.config import KVTierConfig, SpeculativeConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.sampling_params import greedy

log = logging.getLogger(__name__)

PROFILE_TOKENS = 256  # one step of a replica that decodes (scheduler.decode_step_prefill_tokens)
REPEATS = 2
WARMUP_TOKENS = 16
SOURCE = "measured at start-up"
SAVED_SOURCE = "saved with the model cache (measured at start-up)"
PROFILE_VERSION = 1  # bump when what is measured changes meaning
# Saved only when the timed runs had the cores: measured on 2 cores here, 0.96-0.99 alone and 0.56-0.59
# beside one busy process (then 1.0 ms a token against 0.6).  A disturbed figure serves this start only.
MIN_CPU_SHARE_TO_SAVE = 0.85


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A measured line, and how much of the timed runs' wall time x threads
    this process got on CPU (1.0: the cores were its own; about 0.56 here
    beside one busy process on 2 cores): only an undisturbed one is saved."""
    model: PrefillModel
    cpu_share: float


def measure_prefill(engine: Engine, tokens: int = PROFILE_TOKENS, repeats: int = REPEATS) -> PrefillModel:
    """Seconds per prompt token of ``engine``'s model, threads and scheduler, from a scratch
    engine beside it (``engine`` itself is not used to compute), as a line through 0."""
    return measure(engine, tokens, repeats).model


def measure(engine: Engine, tokens: int = PROFILE_TOKENS, repeats: int = REPEATS) -> Measurement:
    """measure_prefill's line, with the CPU share of its timed runs."""
    import torch

    cfg = engine.config
    tokens = min(tokens, engine.max_model_len - 1)
    if tokens < 1:
        raise ValueError(f"max_model_len {engine.max_model_len} leaves no prompt to time")
    block = cfg.block_size
    scratch = Engine(dataclasses.replace(
        cfg, num_kv_blocks=(tokens + 2 * block) // block + 1, enable_prefix_caching=False,
        kv_tiers=KVTierConfig(), speculative=SpeculativeConfig(), grammar_compile_workers=1,
        kv_quotas=()), loaded=engine.loaded)
    try:
        _prefill_s(scratch, min(WARMUP_TOKENS, tokens), "warmup")
        cpu0 = time.process_time()
        runs = [_prefill_s(scratch, tokens, str(r)) for r in range(max(repeats, 1))]
        cpu_s = time.process_time() - cpu0
    finally:
        scratch.close()
    share = cpu_s / max(sum(runs) * torch.get_num_threads(), 1e-9)
    return Measurement(PrefillModel(overhead_s=0.0, per_token_s=min(runs) / tokens, source=SOURCE), share)


def _prefill_s(engine: Engine, tokens: int, tag: str) -> float:
    """Seconds from adding a ``tokens``-token prompt to its first token (every step it takes)."""
    vocab = engine.loaded.config.vocab_size
    prompt = [(1000 + 7919 * i) % vocab for i in range(tokens)]
    engine.add_request(f"startup-profile-{tag}", prompt, greedy(1, ignore_eos=True))
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def measure_or_none(engine: Engine) -> PrefillModel | None:
    """The saved profile of ``engine``'s setting, else measure_prefill (then
    saved), else None (logged) when it cannot: the configured line stays."""
    path = saved_file(engine)
    saved = read_saved(path) if path is not None else None
    if saved is not None:
        log.info("start-up prefill profile: %s (%s)", saved.describe("tokens"), path)
        return saved
    try:
        measured = measure(engine)
    except Exception as exc:  # noqa: BLE001 - a replica serves without its profile
        log.warning("start-up prefill profile not measured (%s): admission keeps the configured speed model", exc)
        return None
    log.info("start-up prefill profile: %s (CPU share %.2f)", measured.model.describe("tokens"), measured.cpu_share)
    if path is not None and measured.cpu_share >= MIN_CPU_SHARE_TO_SAVE:
        save(path, measured.model, profile_setting(engine))
    return measured.model


def profile_setting(engine: Engine) -> dict:
    """What sets the measured speed, besides the weights' file (the cache directory names that)."""
    import torch

    from pdcluster.kernels import cpu_native

    cfg = engine.config
    kernels = cpu_native.variant()
    return {"version": PROFILE_VERSION, "tokens": min(PROFILE_TOKENS, engine.max_model_len - 1),
            "dtype": str(cfg.dtype), "weight_dtype": engine.loaded.weight_dtype, "kv_cache_dtype": cfg.kv_cache_dtype,
            "threads": torch.get_num_threads(), "block_size": cfg.block_size,
            "scheduler": repr(cfg.scheduler), "kernels": kernels.name if kernels is not None else "off",
            "cpu": _cpu_model(), "cpus": os.cpu_count(), "device": str(cfg.device)}


def saved_file(engine: Engine) -> Path | None:
    """Where ``engine``'s setting's profile is saved: beside the converted GGUF;
    None for a model that is not a cached GGUF."""
    from pdcluster.services import model_cache
    from pdcluster.services.model_meta import is_gguf

    path = engine.loaded.path
    if not is_gguf(path):
        return None
    key = hashlib.blake2b(json.dumps(profile_setting(engine), sort_keys=True).encode(), digest_size=8).hexdigest()
    return model_cache.converted(path) / f"prefill-profile-{key}.json"


def read_saved(path: Path) -> PrefillModel | None:
    """The profile saved at ``path``; None when there is none or it does not parse to a sane time."""
    try:
        per_token_s = float(json.loads(path.read_text())["per_token_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not 0 < per_token_s < 1:
        return None
    return PrefillModel(overhead_s=0.0, per_token_s=per_token_s, source=SAVED_SOURCE)


def save(path: Path, model: PrefillModel, setting: dict) -> None:
    """Written whole or not at all (a temporary file renamed into place); a
    cache that cannot be written only costs the next start a measurement."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"per_token_s": model.per_token_s, "measured_at": time.time(),
                                   "setting": setting}, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.info("start-up prefill profile not saved (%s)", exc)
    finally:
        tmp.unlink(missing_ok=True)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
