"""The speed model of one replica: decode step time vs batch, prefill time
vs prompt length.  Shared by admission and placement (pdcluster/services/gateway),
the autoscaler (pdcluster/services/autoscale) and the planner (planner.py, which fits
and rooflines them in perf_model.py).

    step(B)    = max(base_s + per_seq_s x B, compute_per_seq_s x B)
    prefill(n) = overhead_s + per_token_s x n + per_token2_s x n^2
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
