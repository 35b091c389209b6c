"""A cumulative histogram as plain data: what a replica publishes on the
status board and the gateway sums across replicas before writing a
Prometheus ``histogram`` family (prometheus_client's own Histogram cannot be
read back, summed or sent over Redis).

    boundaries   (b0, b1, ..., bk)          upper bounds, ascending; +Inf implied
    counts       [c0, c1, ..., ck, c_inf]   observations with b(i-1) < v <= b(i)
                                            (not cumulative: Prometheus's le=
                                            buckets are the running sums)

A snapshot is ``{"boundaries": [...], "counts": [...], "sum": s}``: JSON,
so it rides in a replica's status unchanged."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class CumulativeHistogram:
    boundaries: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if list(self.boundaries) != sorted(set(self.boundaries)) or not self.boundaries:
            raise ValueError(f"histogram boundaries {self.boundaries} must be distinct and ascending")
        if not self.counts:
            self.counts = [0] * (len(self.boundaries) + 1)
        if len(self.counts) != len(self.boundaries) + 1:
            raise ValueError(f"{len(self.counts)} counts for {len(self.boundaries)} boundaries: "
                             f"need one per boundary plus +Inf")

    def observe(self, value: float) -> None:
        """Negative or NaN values are dropped (a clock that stepped back)."""
        if not value >= 0:
            return
        self.counts[bisect.bisect_left(self.boundaries, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations <= le) as Prometheus writes ``_bucket``, +Inf last."""
        out, running = [], 0
        for bound, n in zip((*self.boundaries, math.inf), self.counts):
            running += n
            out.append(("+Inf" if bound == math.inf else _le(bound), running))
        return out

    def snapshot(self) -> dict:
        return {"boundaries": list(self.boundaries), "counts": list(self.counts), "sum": self.sum}

    @classmethod
    def from_snapshot(cls, snap: dict) -> "CumulativeHistogram":
        """Raises ValueError (or KeyError/TypeError) on a malformed snapshot."""
        counts = [int(c) for c in snap["counts"]]
        if any(c < 0 for c in counts):
            raise ValueError("negative histogram count")
        return cls(tuple(float(b) for b in snap["boundaries"]), counts, float(snap["sum"]))


def merged(boundaries: Sequence[float], parts: Iterable[CumulativeHistogram]) -> CumulativeHistogram:
    """The sum of ``parts``; one with other boundaries is skipped (it cannot
    be re-bucketed exactly)."""
    total = CumulativeHistogram(tuple(boundaries))
    for part in parts:
        if part.boundaries != total.boundaries:
            continue
        total.counts = [a + b for a, b in zip(total.counts, part.counts)]
        total.sum += part.sum
    return total


def _le(bound: float) -> str:
    """prometheus_client's spelling of a bucket bound (0.5 -> "0.5", 1 -> "1.0")."""
    return repr(float(bound))
