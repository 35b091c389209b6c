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
replica's start on this machine."""

from __future__ import annotations

import dataclasses
import logging
import time

from pdcluster.planning.speed import PrefillModel
from pdcluster.services.engine.config import KVTierConfig, SpeculativeConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.sampling_params import greedy

log = logging.getLogger(__name__)

PROFILE_TOKENS = 256  # one step of a replica that decodes (scheduler.decode_step_prefill_tokens)
REPEATS = 2
WARMUP_TOKENS = 16
SOURCE = "measured at start-up"


def measure_prefill(engine: Engine, tokens: int = PROFILE_TOKENS, repeats: int = REPEATS) -> PrefillModel:
    """Seconds per prompt token of ``engine``'s model, threads and scheduler, from a scratch
    engine beside it (``engine`` itself is not used to compute), as a line through 0."""
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
        fastest = min(_prefill_s(scratch, tokens, str(r)) for r in range(max(repeats, 1)))
    finally:
        scratch.close()
    return PrefillModel(overhead_s=0.0, per_token_s=fastest / tokens, source=SOURCE)


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
    """measure_prefill, or None (logged) when it cannot: the configured line stays."""
    try:
        model = measure_prefill(engine)
    except Exception as exc:  # noqa: BLE001 - a replica serves without its profile
        log.warning("start-up prefill profile not measured (%s): admission keeps the configured speed model", exc)
        return None
    log.info("start-up prefill profile: %s", model.describe("tokens"))
    return model
