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
one untimed warm-up, then one of LONG_PROFILE_TOKENS once (fewer on a slow
replica: long_prompt_tokens); the prefill line
admission adopts goes through the fastest short time and the long one:
t(n) = per_token x n + per_token2 x n^2 (attention grows with the prompt),
no separate overhead (each chunk's step overhead is in per_token).  The
configured per_token2 (1.7e-7 s, one machine's 1-thread replica) said 2.35 s
for a lone 3,072-token prompt that a 2-thread Sapphire Rapids engine
(512-token chunks, no prefix cache) prefilled in 1.03 s (256 tokens 57 ms,
1,024 244 ms, 2,048 581 ms), so
admission refused long prompts it could serve.  The prompts go through the
step sizes the replica's scheduler takes, so chunking costs what it costs
in service.  About 1 s of one replica's start on that machine.

A replica that decodes also draws its decode step line (measure_step): the
fastest decode-only step of 1 and of 16 streams of 64-token prompts, on a
scratch engine the same way; admission takes it in place of the configured
step line (about 0.5 s on a 2-core Sapphire Rapids).

Both are saved with the model cache (profile_store.py): once three
measurements on this machine, weights and settings went in, a replica that
starts reads the fastest of them instead of measuring (``start_up_profiles``)."""

from __future__ import annotations

import dataclasses
import logging
import time

from pdcluster.planning.speed import PrefillModel, StepModel
from pdcluster.services.engine.config import KVTierConfig, SpeculativeConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.sampling_params import greedy
from pdcluster.services.pools.profile_store import ProfileStore, fold, reusable

log = logging.getLogger(__name__)

PROFILE_TOKENS = 256  # one step of a replica that decodes (scheduler.decode_step_prefill_tokens)
LONG_PROFILE_TOKENS = 1536  # long enough for attention's square to show ...
LONG_BUDGET_S = 0.5  # ... and shorter where the short prompt says it would take longer than this (slow classes)
REPEATS = 2
WARMUP_TOKENS = 16
SOURCE = "measured at start-up"
STEP_BATCHES = (1, 16)  # decode batches the step line is drawn through
STEP_REPEATS = 4        # decode-only steps timed at each (the fastest counts)


def measure_prefill(engine: Engine, tokens: int = PROFILE_TOKENS, repeats: int = REPEATS,
                    long_tokens: int = LONG_PROFILE_TOKENS) -> PrefillModel:
    """The prefill line of ``engine``'s model, threads and scheduler, from a scratch engine beside
    it (``engine`` itself is not used to compute): through 0, the fastest of ``repeats`` prompts of
    ``tokens`` and one of ``long_tokens`` (none when the model's length leaves no longer prompt:
    then a line with no square term)."""
    cfg = engine.config
    tokens = min(tokens, engine.max_model_len - 1)
    long_tokens = min(long_tokens, engine.max_model_len - 1)
    if tokens < 1:
        raise ValueError(f"max_model_len {engine.max_model_len} leaves no prompt to time")
    block = cfg.block_size
    scratch = Engine(dataclasses.replace(
        cfg, num_kv_blocks=(max(tokens, long_tokens) + 2 * block) // block + 1, enable_prefix_caching=False,
        kv_tiers=KVTierConfig(), speculative=SpeculativeConfig(), grammar_compile_workers=1,
        kv_quotas=()), loaded=engine.loaded)
    try:
        _prefill_s(scratch, min(WARMUP_TOKENS, tokens), "warmup")
        fastest = min(_prefill_s(scratch, tokens, str(r)) for r in range(max(repeats, 1)))
        long_tokens = long_prompt_tokens(tokens, fastest, long_tokens)
        long_s = _prefill_s(scratch, long_tokens, "long") if long_tokens > tokens else None
    finally:
        scratch.close()
    per_token, per_token2 = prefill_line(tokens, fastest, long_tokens, long_s)
    return PrefillModel(overhead_s=0.0, per_token_s=per_token, per_token2_s=per_token2, source=SOURCE)


def long_prompt_tokens(short: int, short_s: float, most: int, budget_s: float = LONG_BUDGET_S) -> int:
    """The long prompt's length (pure): at most ``most``, at most what ``budget_s`` prefills at the
    short prompt's pace (its attention then adds some), at least twice the short one (so the two
    points still tell the square term apart).  2-thread Sapphire Rapids (256 tokens in ~60 ms):
    1,536; a replica 9x slower (the AVX2 class's kernels): 512, about a second, not four."""
    if short_s <= 0:
        return most
    return min(most, max(2 * short, int(short * budget_s / short_s)))


def prefill_line(short: int, short_s: float, long: int, long_s: float | None) -> tuple[float, float]:
    """(per_token, per_token2) of t(n) = per_token x n + per_token2 x n^2 through (short, short_s) and
    (long, long_s) (pure).  per_token2 >= 0 (a long prompt timed faster per token than the short one
    is noise: then the short one's line through 0) and per_token > 0."""
    per_short = short_s / short
    if long_s is None or long <= short:
        return per_short, 0.0
    per_token2 = max((long_s / long - per_short) / (long - short), 0.0)
    return max(per_short - per_token2 * short, per_short * 0.5), per_token2


def measure_step(engine: Engine, batches: tuple[int, int] = STEP_BATCHES, repeats: int = STEP_REPEATS) -> StepModel:
    """The decode step line (seconds at batch B = base + per sequence x B) of ``engine``'s model and
    threads, through the fastest decode-only step at each of ``batches``, from a scratch engine beside
    it.  The configured line is one machine's 1-thread replica: on a 2-thread Sapphire Rapids
    replica it said 50 ms at batch 16 where the step took 17 ms, so admission's TPOT bound and its
    model of the streams beside a prompt were three times too slow until streams finished."""
    small, large = batches
    if not 0 < small < large:
        raise ValueError(f"the step line needs two batches, smaller first, got {batches}")
    cfg = engine.config
    block = cfg.block_size
    prompt_tokens = 64  # a context a chat stream holds, so the line carries some attention
    per_seq_blocks = -(-(prompt_tokens + step_max_tokens(large, repeats)) // block) + 1
    scratch = Engine(dataclasses.replace(
        cfg, num_kv_blocks=large * per_seq_blocks + 1, enable_prefix_caching=False, kv_tiers=KVTierConfig(),
        speculative=SpeculativeConfig(), grammar_compile_workers=1, kv_quotas=(),
        scheduler=dataclasses.replace(cfg.scheduler, max_num_seqs=max(cfg.scheduler.max_num_seqs, large))),
        loaded=engine.loaded)
    try:
        times = [_decode_step_s(scratch, b, prompt_tokens, repeats) for b in (small, large)]
    finally:
        scratch.close()
    per_seq = max((times[1] - times[0]) / (large - small), 0.0)
    base = max(times[0] - per_seq * small, 1e-4)
    return StepModel(base_s=base, per_seq_s=per_seq, source=SOURCE)


def step_max_tokens(batch: int, repeats: int) -> int:
    """Tokens each of ``batch`` timed streams may generate (pure): one in each step that prefills
    another's prompt (at most ``batch`` such steps while a step takes a whole 64-token prompt or
    more), one warm-up step, ``repeats`` timed ones, and a spare, so no stream ends before the
    timed steps do.  With ``repeats`` + 3 alone, a replica that decodes (it prefills
    decode_step_prefill_tokens a step beside its streams) finished its first-prefilled streams
    during the timed steps, and the fastest "16-stream" step ran fewer: the saved line said
    11.2 ms at 16 streams where every step of 16 took 17-19 ms (the default colocated replica, AMD
    EPYC avx512_bf16 class, Dec 6)."""
    return batch + repeats + 2


def _decode_step_s(engine: Engine, batch: int, prompt_tokens: int, repeats: int) -> float:
    """The fastest of ``repeats`` decode-only steps of all ``batch`` streams (prefilled first,
    untimed); ValueError where a timed step would not run them all (no line beats a wrong one)."""
    vocab = engine.loaded.config.vocab_size
    params = greedy(step_max_tokens(batch, repeats), ignore_eos=True)
    for i in range(batch):
        prompt = [(1000 + 7919 * (i * prompt_tokens + j)) % vocab for j in range(prompt_tokens)]
        engine.add_request(f"startup-step-{batch}-{i}", prompt, params)
    sched = engine.scheduler
    try:
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
            engine.step()
        fastest = float("inf")
        for timed in (False,) + (True,) * repeats:  # the first decode step of a batch warms what it reads
            streams = sum(1 for r in sched.running if not r.is_finished)
            if streams != batch:
                raise ValueError(f"a decode step meant for {batch} streams would run {streams}")
            started = time.perf_counter()
            engine.step()
            if timed:
                fastest = min(fastest, time.perf_counter() - started)
        return fastest
    finally:
        for i in range(batch):
            engine.abort(f"startup-step-{batch}-{i}")


def _prefill_s(engine: Engine, tokens: int, tag: str) -> float:
    """Seconds from adding a ``tokens``-token prompt to its first token (every step it takes)."""
    vocab = engine.loaded.config.vocab_size
    prompt = [(1000 + 7919 * i) % vocab for i in range(tokens)]
    engine.add_request(f"startup-profile-{tag}", prompt, greedy(1, ignore_eos=True))
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def start_up_profiles(engine: Engine, prefill: bool, step: bool,
                      store: ProfileStore | None) -> tuple[PrefillModel | None, StepModel | None]:
    """The replica's (prefill line, decode step line), each only where asked (else None): read
    from ``store`` when SAMPLES measurements on this machine went into it (profile_store.py),
    else measured here and folded into ``store``; None where it could not be measured."""
    saved = store.load() if store is not None else None
    got_prefill = reusable(saved, "prefill") if prefill else None
    got_step = reusable(saved, "step") if step else None
    for name, line in (("prefill", got_prefill), ("decode step", got_step)):
        if line is not None:
            log.info("start-up %s profile: %s", name, line.describe("tokens" if name == "prefill" else "batch"))
    new_prefill = measure_or_none(engine) if prefill and got_prefill is None else None
    new_step = measure_step_or_none(engine) if step and got_step is None else None
    if store is not None and (new_prefill is not None or new_step is not None):
        folded = fold(store.load(), new_prefill, new_step)  # read again: a neighbour may have folded meanwhile
        store.save(folded)
        # The fastest measured so far, this one included: the least disturbed by a neighbour starting.
        new_prefill = folded.prefill if new_prefill is not None else None
        new_step = folded.step if new_step is not None else None
    return got_prefill or new_prefill, got_step or new_step


def measure_or_none(engine: Engine) -> PrefillModel | None:
    """measure_prefill, or None (logged) when it cannot: the configured line stays."""
    return _measured_or_none(lambda: measure_prefill(engine), "prefill", "tokens")


def measure_step_or_none(engine: Engine) -> StepModel | None:
    """measure_step, or None (logged) when it cannot: the configured step line stays."""
    return _measured_or_none(lambda: measure_step(engine), "decode step", "batch")


def _measured_or_none(measure, what: str, unit: str):
    try:
        model = measure()
    except Exception as exc:  # noqa: BLE001 - a replica serves without its profile
        log.warning("start-up %s profile not measured (%s): admission keeps the configured line", what, exc)
        return None
    log.info("start-up %s profile: %s", what, model.describe(unit))
    return model
