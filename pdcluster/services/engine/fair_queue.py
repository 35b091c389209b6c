"""Fair shares between tenants within one priority: start-time fair queueing.

Each request gets a start tag when it is queued; a queue is ordered by
(priority, start tag).  A tenant's requests follow one another in virtual
time, each advancing its tenant's finish tag by cost / weight (cost: the
tokens it brings to compute), and a tenant that was idle starts at the
clock (the start tag of the request last taken), never in the past::

    start  = max(clock, finish[tenant])
    finish[tenant] = start + cost / weight

    A floods 5 requests of 100 tokens, then B sends one (weights 1, clock 0):
        A: 0, 100, 200, 300, 400        B: 0     -> B runs second, not sixth

With one tenant -- every request's, unless tenants are configured -- the
start tags rise with arrival: first come, first served, as before.  This is
the per-step form of deficit round robin (each backlogged tenant is served
in proportion to its weight) without rounds to tune.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


def start_tag(clock: float, tenant_finish: float, cost: float, weight: float) -> tuple[float, float]:
    """(start, finish) tags of a request of ``cost`` tokens for a tenant whose last
    request finishes at ``tenant_finish`` in virtual time (pure)."""
    if not weight > 0:
        raise ValueError(f"a tenant's weight must be > 0, got {weight!r}")
    start = max(clock, tenant_finish)
    return start, start + max(cost, 1) / weight


@dataclass
class FairClock:
    """The virtual clock and each tenant's finish tag (one per scheduler)."""
    weights: Mapping[str, float] = field(default_factory=dict)   # tenant -> weight (absent: 1)
    clock: float = 0.0
    _finish: dict[str, float] = field(default_factory=dict)

    def tag(self, tenant: str, cost: int) -> float:
        start, finish = start_tag(self.clock, self._finish.get(tenant, 0.0), cost, self.weights.get(tenant, 1.0))
        self._finish[tenant] = finish
        return start

    def taken(self, tag: float) -> None:
        """A request with start tag ``tag`` was scheduled: the clock reaches it.  Tenants
        whose finish lies behind the clock are forgotten (they would start at the clock)."""
        if tag > self.clock:
            self.clock = tag
            if len(self._finish) > 64:
                self._finish = {t: f for t, f in self._finish.items() if f > tag}
