"""What a profile (bench/plan/profiling.py) predicts for a closed loop of C
clients on one prefill + one decode replica: output tok/s, TTFT p50 and
TPOT p50.  Checked against measurement by bench/plan/accuracy.py.

The loop is played step by step as the engines schedule it
(bench/plan/closed_loop.py: arrivals in phase, prefill steps under the
token budget, decode steps over whoever has joined), not solved as a
queueing formula: a closed loop's clients start together and stay in
phase, which a steady-state mean cannot see.  Its speeds, every one a
profile measurement:

    prefill_busy(n)  = prefill(n) - overhead          one step computing n prompt tokens
        prefill(n)   the fitted TTFT line up to the longest profiled prompt, then beyond it (below)
    overhead         send to reaching the engine: the fitted line's intercept less the engine's
                     fixed time per forward, the decode step line's intercept (a prefill step
                     streams the weights once, as a decode step does).  Traced on the AMX
                     machine: a 64-token prompt's prefill.compute span 38-47 ms where
                     prefill(64) - intercept is 18 ms, routing 2-8 ms after the send; charging
                     the whole intercept to the way in left the engine idle then and hid
                     queueing behind it
    jitter           the standard deviation of TTFT between repeats of one prompt length beside
                     decoding (the overlap probe), as a spread of each request's way in; the loop
                     is played ``JITTER_RUNS`` times, one seed each, and every figure pools them
    decode_step(b, ctx) = (step(b) + b x ctx_cost x (ctx - ctx_p)) x skew
        step(b)      the fitted step line at the profile's decode context ctx_p
        ctx_cost     seconds per sequence per token of context: a least-squares slope through the
                     long-context probe's excess over step(b), (gap - step(b)) / (b x (ctx - ctx_p))
        skew         mean inter-token gap / median gap: TPOT is a mean, the step line medians
    handoff          extra time in a request's first inter-token gap (the KV pull)
    slowdowns        each replica's step time while the other computes / alone (overlap probe)

TTFT p50 and TPOT p50 are medians over the simulated requests; output
tok/s = C x output tokens / mean E2E, as the bench measures it.

Prompts longer than the profile's: prefill time continues from the median
measured at the longest profiled prompt along the least-squares parabola
through every profiled length when it bends up (the marginal cost per token
rises), else at the last measured segment's slope.  Which of the two holds
depends on the machine: on AVX2 the marginal cost *fell* as prompts grew
(larger GEMMs ran closer to peak; 5.0 ms/token from 32 to 128 tokens, 4.4
from 128 to 256), so a line through all the points overshot; with the
linears on AMX tiles (2-core Sapphire Rapids, 1 thread) causal attention's
n^2 shows instead: 0.28 ms/token from 128 to 256 tokens, 0.44 from 256 to
384, 0.50 from 384 to 512 (the last segment's slope alone put 512 tokens at
0.18 s, measured 0.23 s).  The extrapolation never assumes long prompts get
cheaper per token than the longest measured.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bench.plan.closed_loop import EngineLimits, Speeds, Workload, simulate
from pdcluster.planning.speed import PrefillModel, StepModel


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    tpot_s: float
    output_tok_s: float
    decode_batch: float  # sequences decoding at once (Little: request rate x decode time)
    prefill_utilization: float


@dataclass(frozen=True)
class PrefillBeyond:
    """Prefill time past the longest profiled prompt (``tokens``, measured ``time_s``):
    time_s + slope_s x (n - tokens) + curvature_s x (n - tokens)^2."""

    tokens: float
    time_s: float
    slope_s: float  # seconds per token at ``tokens``
    curvature_s: float = 0.0  # seconds per token^2, >= 0


@dataclass(frozen=True)
class Gaps:
    handoff_s: float = 0.0
    skew: float = 1.0
    first_token_s: float = 0.0  # a streamed request's TTFT over the profile's prefill line at its length


@dataclass(frozen=True)
class ContextCost:
    per_seq_token_s: float = 0.0  # step seconds per sequence per token of context past the reference
    reference_context: float = 0.0  # the context the step line was measured at


@dataclass(frozen=True)
class Overlap:
    prefill_slowdown: float = 1.0
    decode_slowdown: float = 1.0
    prefill_delay_s: float = 0.0  # a request's way to the prefill engine, longer while decode computes


def prefill_beyond(samples: Sequence[tuple[float, float]]) -> PrefillBeyond | None:
    """From (prompt tokens, TTFT) samples; None with fewer than two lengths.
    With three or more, the least-squares parabola through every length's
    median, when it bends up, continued from the longest length's median
    with its slope and curvature there; else, or with two lengths, the last
    segment's slope.  All lengths, not the last three: on the AMX machine
    the three-point parabola read 0.18 to 0.31 s for 512 tokens from three
    profiles (+-5 ms on one median moves the slope change it rests on), the
    least-squares one 0.19 to 0.25 s (measured 0.23 s)."""
    by_length: dict[float, list[float]] = defaultdict(list)
    for tokens, ttft_s in samples:
        by_length[tokens].append(ttft_s)
    lengths = sorted(by_length)
    if len(lengths) < 2:
        return None
    median = {n: statistics.median(v) for n, v in by_length.items()}  # a cold or preempted sample is one of several
    last, before = lengths[-1], lengths[-2]
    slope = max((median[last] - median[before]) / (last - before), 0.0)
    if len(lengths) < 3:
        return PrefillBeyond(last, median[last], slope)
    curvature, linear, _ = np.polyfit(lengths, [median[n] for n in lengths], 2)
    if curvature <= 0:
        return PrefillBeyond(last, median[last], slope)
    return PrefillBeyond(last, median[last], max(linear + 2 * curvature * last, 0.0), float(curvature))


def prefill_at(prefill: PrefillModel, tokens: float, beyond: PrefillBeyond | None) -> float:
    if beyond is None or tokens <= beyond.tokens:
        return prefill.time_s(tokens)
    past = tokens - beyond.tokens
    return beyond.time_s + beyond.slope_s * past + beyond.curvature_s * past * past


def fit_context_cost(step: StepModel, samples: Sequence[tuple[int, float, float]],
                     reference_context: float) -> ContextCost:
    """From (batch, context, median gap) samples at contexts other than the
    reference: the least-squares slope through the origin of the excess over
    step(b) against b x (context - reference), at least 0."""
    xs = [b * (ctx - reference_context) for b, ctx, _ in samples]
    ys = [gap - step.step_s(b) for b, _, gap in samples]
    denominator = sum(x * x for x in xs)
    slope = sum(x * y for x, y in zip(xs, ys)) / denominator if denominator > 0 else 0.0
    return ContextCost(max(slope, 0.0), reference_context)


def decode_step_at(step: StepModel, cost: ContextCost, batch: int, context: float) -> float:
    extra = batch * cost.per_seq_token_s * (context - cost.reference_context)
    return max(step.step_s(batch) + extra, step.base_s)


def way_in(prefill: PrefillModel, step: StepModel) -> float:
    """Send to reaching the prefill engine: the TTFT line's intercept less a forward's fixed time."""
    return max(prefill.overhead_s - max(step.base_s, 0.0), 0.0)


def speeds(step: StepModel, prefill: PrefillModel, *, beyond: PrefillBeyond | None = None, gaps: Gaps = Gaps(),
           context: ContextCost = ContextCost(), overlap: Overlap = Overlap(), jitter_s: float = 0.0) -> Speeds:
    overhead_s = way_in(prefill, step)
    return Speeds(
        overhead_s=overhead_s + gaps.first_token_s,
        prefill_busy_s=lambda n: max(prefill_at(prefill, n, beyond) - overhead_s, 1e-6),
        decode_step_s=lambda b, ctx: decode_step_at(step, context, b, ctx) * gaps.skew,
        handoff_s=gaps.handoff_s, prefill_slowdown=overlap.prefill_slowdown, decode_slowdown=overlap.decode_slowdown,
        prefill_delay_s=overlap.prefill_delay_s, arrival_jitter_s=jitter_s)


JITTER_RUNS = 32


def predict_closed_loop(s: Speeds, *, concurrency: int, requests_per_client: int, prompt_tokens: int,
                        output_tokens: int, limits: EngineLimits = EngineLimits()) -> Prediction:
    work = Workload(concurrency, requests_per_client, prompt_tokens, output_tokens)
    runs = JITTER_RUNS if s.arrival_jitter_s > 0 else 1
    timings = [t for seed in range(runs) for t in simulate(s, work, limits, seed)]
    mean_e2e = statistics.mean(t.e2e_s for t in timings)
    rate = concurrency / mean_e2e  # requests/s, Little on the whole loop
    decoding_s = statistics.mean(t.e2e_s - t.ttft_s for t in timings)
    return Prediction(
        ttft_s=statistics.median(t.ttft_s for t in timings), tpot_s=statistics.median(t.tpot_s for t in timings),
        output_tok_s=rate * output_tokens, decode_batch=rate * decoding_s,
        prefill_utilization=min(rate * s.prefill_busy_s(prompt_tokens), 1.0))
