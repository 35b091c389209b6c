"""Distribution summaries.  Percentiles are numpy's default (linear
interpolation between order statistics), the same as ``vllm bench serve``,
so every figure can be recomputed from the raw samples in the JSON."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Dist:
    count: int
    mean: float
    min: float
    p50: float
    p95: float
    p99: float
    max: float

    def at(self, percentile: float) -> float:
        return {50: self.p50, 95: self.p95, 99: self.p99}.get(percentile, float("nan"))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``; NaN for no samples."""
    if len(values) == 0:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(values: Sequence[float]) -> Dist | None:
    """None for no samples (a metric that no request produced)."""
    if len(values) == 0:
        return None
    x = np.asarray(values, dtype=float)
    p50, p95, p99 = np.percentile(x, PERCENTILES)
    return Dist(len(x), float(x.mean()), float(x.min()), float(p50), float(p95), float(p99), float(x.max()))
