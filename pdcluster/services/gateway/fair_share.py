"""Fair shares at admission: how much queued work a new request waits behind,
and whether a tenant may take one of the last decode seats (pure rules).

The replicas order their queues by priority, then by each tenant's fair share
(pdcluster/services/engine/fair_queue.py).  So a request of tenant t at priority p waits
behind every queued token of a more urgent priority, its own tenant's queued
tokens, and -- from each other tenant u of its priority -- at most what u is
served while t's queue and this prompt are served (weights w)::

    ahead = sum(queued[q, u] for q < p)
          + queued[p, t]
          + sum(min(queued[p, u], (queued[p, t] + prompt) * w_u / w_t) for u != t)

A flood by one tenant lengthens its own predicted TTFT, so admission refuses
the flood's excess (its SLO would break) and not the others' requests.

Decode seats (each stream holds one from admission to its end).  ``slo``
of them is what the decode pool runs within the TPOT SLO (the step model,
calibrated); past it every stream's TPOT suffers.  The tenants that sent a
request lately (``active``) share ``slo`` by weight::

    share[t] = slo x w_t / sum(w_u for u active)
    keep     = one seat for each other active tenant below its share (its next request)
    t takes a seat  while taken < slo - keep,  or while it holds fewer than share[t]

so one tenant's flood takes what the others leave and no more: it can
neither take the seat another's next request needs nor slow the others'
streams past their SLO.  A tenant alone takes every seat (served late rather
than refused)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

Class = tuple[int, str]  # (priority, tenant)


def tokens_ahead(queued: Mapping[Class, int], tenant: str, priority: int, prompt_tokens: int,
                 weights: Mapping[str, float]) -> int:
    own = queued.get((priority, tenant), 0)
    w_t = weights.get(tenant, 1.0)
    ahead = 0.0
    for (p, u), q in queued.items():
        if p < priority or (p == priority and u == tenant):
            ahead += q
        elif p == priority:
            ahead += min(q, (own + prompt_tokens) * weights.get(u, 1.0) / w_t)
    return int(ahead)


def may_take_seat(streams: Mapping[str, int], tenant: str, seats: int, weights: Mapping[str, float],
                  slo: int | None = None, active: Collection[str] = ()) -> bool:
    """Whether ``tenant`` may take a decode seat now (``streams``: seats each tenant holds;
    ``slo``: streams within the TPOT SLO, default every seat; ``active``: tenants that sent
    a request lately, besides those holding streams)."""
    taken = sum(streams.values())
    if taken >= seats:
        return False
    others = ({u for u, n in streams.items() if n > 0} | set(active)) - {tenant}
    if not others:
        return True
    slo = seats if slo is None else min(max(slo, 1), seats)
    total_weight = weights.get(tenant, 1.0) + sum(weights.get(u, 1.0) for u in others)

    def share(u: str) -> float:
        return slo * weights.get(u, 1.0) / total_weight

    keep = sum(1 for u in others if streams.get(u, 0) < share(u))
    return taken < slo - keep or streams.get(tenant, 0) < share(tenant)
