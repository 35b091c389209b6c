"""Fair shares at admission: how much queued work a new request waits behind,
and whether a tenant may take one of the last decode seats (pure rules).

The replicas order their queues by priority, then by each tenant's fair share
(services/engine/fair_queue.py).  So a request of tenant t at priority p waits
behind every queued token of a more urgent priority, its own tenant's queued
tokens, and -- from each other tenant u of its priority -- at most what u is
served while t's queue and this prompt are served (weights w)::

    ahead = sum(queued[q, u] for q < p)
          + queued[p, t]
          + sum(min(queued[p, u], (queued[p, t] + prompt) * w_u / w_t) for u != t)

A flood by one tenant lengthens its own predicted TTFT, so admission refuses
the flood's excess (its SLO would break) and not the others' requests.

Decode seats (each stream holds one from admission to its end): while more
than ``reserve`` seats are free anyone takes one; the last ``reserve`` go only
to a tenant below its weighted share of the seats among the tenants holding
streams, so one tenant's flood cannot take the seat another's next request
needs.  With one tenant the share is every seat: nothing changes."""

from __future__ import annotations

from collections.abc import Mapping

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


def seat_reserve(seats: int) -> int:
    """Seats kept back from tenants at or over their share: an eighth, at least one."""
    return max(1, seats // 8)


def may_take_seat(streams: Mapping[str, int], tenant: str, seats: int, weights: Mapping[str, float]) -> bool:
    """Whether ``tenant`` may take a decode seat now (``streams``: seats each tenant holds)."""
    taken = sum(streams.values())
    if taken >= seats:
        return False
    if seats - taken > seat_reserve(seats):
        return True
    holders = {u for u, n in streams.items() if n > 0} | {tenant}
    total_weight = sum(weights.get(u, 1.0) for u in holders)
    share = seats * weights.get(tenant, 1.0) / total_weight
    return streams.get(tenant, 0) < share
