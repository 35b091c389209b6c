"""KV-cache events as the engine reports them, and the batch a worker publishes.

The engine calls ``on_event(kind, block_hashes)`` with ``kind`` in
{"stored", "evicted"}.  Within a batch only the *last* event per block counts
(stored-then-evicted is evicted; evicted-then-stored is stored): the index is
a set per block, so the final state is all that needs to travel.

Those are the device pool's events.  With tiers under the pool
(pdcluster/services/engine/kv_tiers.py) a block can also be stored in or evicted from
the ``host`` or ``disk`` tier: the same rule, per (block, tier), kept apart
from the device's so a consumer that knows no tiers reads what it always did::

    device   last_kind[hash]           -> kind
    tiers    tier_kind[(hash, tier)]   -> kind      tier in LOWER_TIERS
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack

EVENT_KINDS: tuple[str, ...] = ("stored", "evicted")
DEVICE = "device"
LOWER_TIERS: tuple[str, ...] = ("host", "disk")  # under the device pool, cheapest to load first
TIERS: tuple[str, ...] = (DEVICE, *LOWER_TIERS)
MAX_HASH = 2**64 - 1


def check_kind(kind: str) -> None:
    if kind not in EVENT_KINDS:
        raise ValueError(f"KV event kind {kind!r} is unknown: use one of {EVENT_KINDS}")


def check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"KV tier {tier!r} is unknown: use one of {TIERS}")


def _check_hash(h: int) -> int:
    h = int(h)
    if not 0 <= h <= MAX_HASH:
        raise ValueError(f"block hash {h} is not an unsigned 64-bit int: use pdcluster.prefix_store.hashing")
    return h


@dataclass
class EventBatch:
    """Coalesced events: block hash -> last kind seen, in first-seen order."""

    last_kind: dict[int, str] = field(default_factory=dict)
    tier_kind: dict[tuple[int, str], str] = field(default_factory=dict)  # host / disk

    def add(self, kind: str, block_hashes: Iterable[int], tier: str = DEVICE) -> None:
        check_kind(kind)
        check_tier(tier)
        if tier != DEVICE:
            for h in block_hashes:
                key = (_check_hash(h), tier)
                self.tier_kind.pop(key, None)
                self.tier_kind[key] = kind
            return
        for h in block_hashes:
            h = _check_hash(h)
            self.last_kind.pop(h, None)  # re-insert so order follows the last event
            self.last_kind[h] = kind

    def merge(self, newer: "EventBatch") -> None:
        """Applies ``newer``'s events after this batch's."""
        for h, kind in newer.last_kind.items():
            self.add(kind, [h])
        for (h, tier), kind in newer.tier_kind.items():
            self.add(kind, [h], tier)

    def stored_in(self, tier: str) -> list[int]:
        if tier == DEVICE:
            return self.stored
        return [h for (h, t), k in self.tier_kind.items() if t == tier and k == "stored"]

    def evicted_from(self, tier: str) -> list[int]:
        if tier == DEVICE:
            return self.evicted
        return [h for (h, t), k in self.tier_kind.items() if t == tier and k == "evicted"]

    @property
    def stored(self) -> list[int]:
        return [h for h, k in self.last_kind.items() if k == "stored"]

    @property
    def evicted(self) -> list[int]:
        return [h for h, k in self.last_kind.items() if k == "evicted"]

    def __len__(self) -> int:
        return len(self.last_kind) + len(self.tier_kind)

    @classmethod
    def of(cls, stored: Iterable[int] = (), evicted: Iterable[int] = (),
           tiers: dict[str, dict[str, Iterable[int]]] | None = None) -> "EventBatch":
        """``tiers``: {"host": {"stored": [...], "evicted": [...]}, "disk": {...}}."""
        batch = cls()
        batch.add("stored", stored)
        batch.add("evicted", evicted)
        for tier, kinds in (tiers or {}).items():
            for kind in EVENT_KINDS:
                batch.add(kind, kinds.get(kind, ()), tier)
        return batch

    def to_msgpack(self) -> bytes:
        """Wire form for shipping a batch between processes."""
        tiers = {t: {"stored": self.stored_in(t), "evicted": self.evicted_from(t)} for t in LOWER_TIERS}
        return msgpack.packb({"stored": self.stored, "evicted": self.evicted,
                              "tiers": {t: k for t, k in tiers.items() if k["stored"] or k["evicted"]}})

    @classmethod
    def from_msgpack(cls, data: bytes) -> "EventBatch":
        obj = msgpack.unpackb(data)
        return cls.of(stored=obj.get("stored", ()), evicted=obj.get("evicted", ()), tiers=obj.get("tiers"))
