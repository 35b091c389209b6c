"""Per-tenant shares of one replica's KV blocks: which cached block to evict.

A block is charged to the tenant whose request allocated it, while that
request holds it and, once it is a cached prefix, until it is evicted.  A
tenant may be given a guaranteed share (its cached blocks up to that many
are kept whatever the others send) and a maximum share (past it, its own
cached blocks go first).  Eviction takes the least recently released block
of the first class that has one::

    1. the requester's own, while it is at its maximum
    2. any tenant's above its guarantee, or the requester's own
    3. any at all (only when every evictable block is guaranteed: counted,
       since refusing the allocation would stall the engine)

Without quotas, this is plain LRU (the first block of class 2)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVQuota:
    """Blocks per tenant (absent: guarantee 0, maximum the whole pool)."""
    guaranteed: Mapping[str, int] = field(default_factory=dict)
    maximum: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of_shares(cls, shares: Iterable[tuple[str, float, float]], num_blocks: int) -> "KVQuota":
        """From (tenant, guaranteed share, maximum share) of a pool of ``num_blocks``."""
        g, m = {}, {}
        for tenant, guaranteed, maximum in shares:
            if not 0 <= guaranteed <= maximum <= 1:
                raise ValueError(f"tenant {tenant!r}: need 0 <= kv_guaranteed ({guaranteed}) <= kv_max ({maximum}) <= 1")
            if guaranteed > 0:
                g[tenant] = math.floor(guaranteed * num_blocks)
            if maximum < 1:
                m[tenant] = max(math.ceil(maximum * num_blocks), 1)
        return cls(g, m)

    @property
    def active(self) -> bool:
        return bool(self.guaranteed or self.maximum)

    def at_max(self, tenant: str, charged: int) -> bool:
        limit = self.maximum.get(tenant)
        return limit is not None and charged >= limit

    def protected(self, owner: str, charged: int) -> bool:
        return charged <= self.guaranteed.get(owner, 0)


@dataclass(frozen=True)
class Victims:
    block_ids: list[int]
    num_guaranteed: int   # of them, taken from a tenant within its guarantee (class 3)


def pick_victims(lru: list[tuple[int, str]], n: int, charged: Mapping[str, int], quota: KVQuota,
                 requester: str, requester_new: int = 0) -> Victims:
    """``n`` evictable blocks to reuse for ``requester``, from ``lru`` ((block, owner),
    least recently released first), by the classes above (pure).  ``charged``: blocks
    charged per tenant now; ``requester_new``: blocks it takes from the free list in
    the same allocation."""
    left = dict(charged)
    left[requester] = left.get(requester, 0) + requester_new
    taken: set[int] = set()
    out: list[int] = []

    def take(b: int, owner: str) -> None:
        taken.add(b)
        out.append(b)
        left[owner] = left.get(owner, 0) - 1
        left[requester] = left.get(requester, 0) + 1

    for b, owner in lru:  # 1. its own, while at its maximum
        if len(out) == n or not quota.at_max(requester, left.get(requester, 0)):
            break
        if owner == requester:
            take(b, owner)
    for b, owner in lru:  # 2. above a guarantee, or its own
        if len(out) == n:
            break
        if b not in taken and (owner == requester or not quota.protected(owner, left.get(owner, 0))):
            take(b, owner)
    first_guaranteed = len(out)
    for b, owner in lru:  # 3. anything left
        if len(out) == n:
            break
        if b not in taken:
            take(b, owner)
    return Victims(out, len(out) - first_guaranteed)


def largest_charges(charged: Mapping[str, int], top: int = 16) -> dict[str, int]:
    """The ``top`` tenants by blocks charged, the rest summed as ``other`` (a bounded view)."""
    ranked = sorted(charged.items(), key=lambda kv: (-kv[1], kv[0]))
    out = dict(ranked[:top])
    rest = sum(n for _, n in ranked[top:])
    if rest:
        out["other"] = out.get("other", 0) + rest
    return out
