"""The speed model of one replica: decode step time vs batch, prefill time
vs prompt length, and where its numbers come from: datasheet rooflines, or
a fit to measurements (bench/plan/profiling.py measures an endpoint).
Shared by admission and placement (pdcluster/services/gateway), the
autoscaler (pdcluster/services/autoscale) and the planner (planner.py);
calibration.py keeps it true to the traffic the gateway sees.

    step(B)    = max(base_s + per_seq_s x B, compute_per_seq_s x B)
      roofline: base_s            = weights/device / (bandwidth x mbu)
                per_seq_s         = decode context x KV bytes/token/dev / (bandwidth x mbu)
                compute_per_seq_s = 2 x params / tp / (FLOP/s x mfu)
                decode context    = input_mean + output_mean / 2 (tokens a sequence holds on average)
      measured: least-squares line through (batch, median inter-token gap)
    prefill(n) = overhead_s + per_token_s x n + per_token2_s x n^2
      roofline: per_token_s  = 2 x params / (FLOP/s x tp x mfu)
                per_token2_s = 2 x layers x heads x head_dim / (FLOP/s x tp x mfu)   (causal attention)
      measured: least-squares line through (prompt tokens, TTFT of a 1-token request)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pdcluster.planning.inputs import Accelerator, Deployment, ModelShape

_UNBOUNDED_BATCH = 1_000_000


def _term(x: float | str) -> str:
    return x if isinstance(x, str) else f"{x:g}"


@dataclass(frozen=True)
class StepModel:
    base_s: float
    per_seq_s: float
    compute_per_seq_s: float = 0.0
    source: str = "roofline"

    def step_s(self, batch: float) -> float:
        return max(self.base_s + self.per_seq_s * batch, self.compute_per_seq_s * batch)

    def rows_s(self, batch: float) -> float:
        """What ``batch`` decode rows add to a step that runs anyway (a prefill chunk's): their
        own share of the step, not its base, which streams the weights once for every row."""
        return (self.per_seq_s + self.compute_per_seq_s) * batch

    def max_batch_within(self, tpot_s: float) -> int:
        """Largest batch whose step time stays within ``tpot_s`` (0 if none)."""
        if self.base_s > tpot_s:
            return 0
        limits = [_UNBOUNDED_BATCH]
        if self.per_seq_s > 0:
            limits.append((tpot_s - self.base_s) / self.per_seq_s)
        if self.compute_per_seq_s > 0:
            limits.append(tpot_s / self.compute_per_seq_s)
        return int(math.floor(min(limits) + 1e-9))

    def describe(self, batch: float | str) -> str:
        b = _term(batch)
        text = f"{self.source}: {self.base_s:.4g} s + {self.per_seq_s:.4g} s x {b}"
        if self.compute_per_seq_s:
            text = f"max({text}, compute {self.compute_per_seq_s:.4g} s x {b})"
        return text


@dataclass(frozen=True)
class PrefillModel:
    overhead_s: float
    per_token_s: float
    per_token2_s: float = 0.0
    source: str = "roofline"

    def time_s(self, tokens: float) -> float:
        return self.overhead_s + self.per_token_s * tokens + self.per_token2_s * tokens**2

    def describe(self, tokens: float | str) -> str:
        n = _term(tokens)
        text = f"{self.source}: {self.overhead_s:.4g} s + {self.per_token_s:.4g} s x {n}"
        if self.per_token2_s:
            text += f" + {self.per_token2_s:.4g} s x {n}^2"
        return text


# ---- where the numbers come from -------------------------------------------


def roofline_step(
    m: ModelShape, a: Accelerator, d: Deployment, weights_dev_bytes: float, kv_dev_bytes: float, decode_context: float
) -> StepModel:
    bandwidth = a.bandwidth_bytes_s * d.mbu
    return StepModel(
        base_s=weights_dev_bytes / bandwidth,
        per_seq_s=decode_context * kv_dev_bytes / bandwidth,
        compute_per_seq_s=2 * m.params / d.tp / (a.flops * d.mfu),
        source=f"roofline (mbu {d.mbu:g}, mfu {d.mfu:g})",
    )


def roofline_prefill(m: ModelShape, a: Accelerator, d: Deployment) -> PrefillModel:
    flops = a.flops * d.tp * d.mfu
    return PrefillModel(
        overhead_s=0.0,
        per_token_s=2 * m.params / flops,
        per_token2_s=2 * m.num_layers * m.num_heads * m.head_dim / flops,
        source=f"roofline (mfu {d.mfu:g})",
    )


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares intercept and slope, both clamped at >= 0."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        return float(np.mean(y)), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        return float(np.mean(y)), 0.0
    if intercept < 0:
        return 0.0, float(np.sum(x * y) / np.sum(x * x))
    return float(intercept), float(slope)


def fit_step(batches: Sequence[float], step_s: Sequence[float]) -> StepModel:
    base, per_seq = _line(batches, step_s)
    return StepModel(base_s=base, per_seq_s=per_seq, source="measured")


def fit_prefill(prompt_tokens: Sequence[float], ttft_s: Sequence[float]) -> PrefillModel:
    overhead, per_token = _line(prompt_tokens, ttft_s)
    if per_token <= 0:
        raise ValueError("TTFT did not grow with prompt length: cannot infer a prefill rate; "
                         "check the server is not caching the profile prompts, or profile longer prompts")
    return PrefillModel(overhead_s=overhead, per_token_s=per_token, source="measured")
