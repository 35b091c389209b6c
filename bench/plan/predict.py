"""What the planner's speed model (perf_model.py, fitted by a profile)
predicts for a closed loop of C clients on one prefill + one decode
replica: output tok/s, TTFT p50 and TPOT p50.  Pure arithmetic, checked
against measurement by bench/plan/accuracy.py.

A closed loop is a closed queueing network, so it is solved with mean
value analysis (exact for a closed loop's populations 1..C), with two
stations: the prefill replica (one request at a time) and the rest of a
request's life (overhead and decoding, during which it waits for no one):

    S        = prefill(P)                     one P-token prompt, alone
    busy     = S - overhead                   the part that occupies the prefill replica
    for n = 1 .. C clients:
      R(n)   = busy x (1 + Q(n-1)) - busy/2 x U(n-1)   wait behind the queue; the request in service has
                                                       busy/2 left on average (deterministic service)
      D(n)   = (O - 1) x gap(b(n)) + handoff  O output tokens, the first comes with prefill
      X(n)   = min(n / (R(n) + overhead + D(n)), 1 / busy)   requests/s (Little on the whole loop; the
                                                       prefill replica bounds it; then R(n) = n / X(n) - overhead - D(n))
      b(n)   = X(n) x D(n)                    Little: sequences decoding at once (solved with D(n))
      Q(n)   = X(n) x R(n),  U(n) = X(n) x busy
    gap(b) = step(b, ctx) x skew
    TTFT   = R(C) + overhead,  TPOT = gap(b(C)) + handoff / (O - 1),  tok/s = X(C) x O

Two terms the profile's fitted lines do not carry, both measured by the
profile's own probe (bench/plan/accuracy.py ``measure_gaps``):
  handoff  the decode replica pulls the prompt's KV and joins its batch
           between the first token and the second: one longer gap per request
  skew     mean inter-token gap / median gap: the profile reports the median
           step, TPOT is a mean, and the gaps are right-skewed (a late step
           now and then: another process, a prefill joining the batch)

Context: the profile fits step(b) on short sequences (context ctx_p); a
sequence holding ctx tokens also reads its KV and does attention over it,
4 x layers x heads x head_dim x ctx FLOPs per token next to 2 x params for
the weights, so its per-sequence cost scales by
(2 params + 4 LHd ctx) / (2 params + 4 LHd ctx_p).

Prompts longer than the profile's: prefill time continues from the mean
measured at the longest profiled prompt at the slope of the last measured
segment.  Not the fitted line, nor a causal-attention n^2 term: measured on
our engine, the marginal cost per token *falls* as prompts grow (larger
GEMMs run closer to peak; 5.0 ms/token from 32 to 128 tokens, 4.4 from 128
to 256 on the CI machine), so a line through all the points overshoots, and
an n^2 term more so; the last segment is the measurement nearest the regime
extrapolated into.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from bench.plan.perf_model import PrefillModel, StepModel
from bench.plan.inputs import ModelShape

_ITERATIONS = 200


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    tpot_s: float
    output_tok_s: float
    decode_batch: float  # sequences decoding at once
    prefill_utilization: float


@dataclass(frozen=True)
class PrefillBeyond:
    """Prefill time past the longest profiled prompt (``tokens``, measured ``time_s``)."""

    tokens: float
    time_s: float
    slope_s: float  # seconds per token of the last measured segment


@dataclass(frozen=True)
class Gaps:
    handoff_s: float = 0.0
    skew: float = 1.0


def prefill_beyond(samples: Sequence[tuple[float, float]]) -> PrefillBeyond | None:
    """From (prompt tokens, TTFT) samples; None with fewer than two lengths."""
    by_length: dict[float, list[float]] = defaultdict(list)
    for tokens, ttft_s in samples:
        by_length[tokens].append(ttft_s)
    lengths = sorted(by_length)
    if len(lengths) < 2:
        return None
    mean = {n: sum(v) / len(v) for n, v in by_length.items()}
    last, before = lengths[-1], lengths[-2]
    return PrefillBeyond(last, mean[last], max((mean[last] - mean[before]) / (last - before), 0.0))


def prefill_at(prefill: PrefillModel, tokens: float, beyond: PrefillBeyond | None) -> float:
    if beyond is None or tokens <= beyond.tokens:
        return prefill.time_s(tokens)
    return beyond.time_s + beyond.slope_s * (tokens - beyond.tokens)


def attention_flops_per_token(m: ModelShape, context: float) -> float:
    return 4.0 * m.num_layers * m.num_heads * m.head_dim * context


def step_at_context(step: StepModel, m: ModelShape, batch: float, context: float, profile_context: float) -> float:
    scale = (2 * m.params + attention_flops_per_token(m, context)) / (2 * m.params + attention_flops_per_token(m, profile_context))
    return step.base_s + step.per_seq_s * batch * scale


def predict_closed_loop(step: StepModel, prefill: PrefillModel, m: ModelShape, *, concurrency: int,
                        prompt_tokens: float, output_tokens: float, profile_context: float,
                        beyond: PrefillBeyond | None = None, gaps: Gaps = Gaps()) -> Prediction:
    service_s = prefill_at(prefill, prompt_tokens, beyond)
    overhead_s = min(prefill.overhead_s, service_s)
    busy_s = max(service_s - overhead_s, 1e-9)
    context = prompt_tokens + output_tokens / 2
    gaps_per_request = max(output_tokens - 1, 0)

    def gap_s(batch: float) -> float:
        return step_at_context(step, m, batch, context, profile_context) * gaps.skew

    queued, utilization = 0.0, 0.0
    residence_s, batch, rate = busy_s, 1.0, 0.0
    for n in range(1, concurrency + 1):
        residence_s = max(busy_s, busy_s * (1 + queued) - busy_s / 2 * utilization)
        for _ in range(_ITERATIONS):  # b(n) and D(n) depend on each other; the map is a contraction
            decode_s = gaps_per_request * gap_s(batch) + gaps.handoff_s
            rate = min(n / (residence_s + overhead_s + decode_s), 1 / busy_s)
            batch = (batch + max(1.0, rate * decode_s)) / 2
        # saturated: the prefill replica sets the pace, and the wait is what the loop's cycle leaves
        residence_s = max(residence_s, n / rate - overhead_s - decode_s)
        queued, utilization = rate * residence_s, rate * busy_s
    tpot_s = gap_s(batch) + gaps.handoff_s / max(gaps_per_request, 1)
    return Prediction(residence_s + overhead_s, tpot_s, rate * output_tokens, batch, utilization)
