"""KV-cache events as the engine reports them, and the batch a worker publishes.

The engine calls ``on_event(kind, block_hashes)`` with ``kind`` in
{"stored", "evicted"}.  Within a batch only the *last* event per block counts
(stored-then-evicted is evicted; evicted-then-stored is stored): the index is
a set per block, so the final state is all that needs to travel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack

EVENT_KINDS: tuple[str, ...] = ("stored", "evicted")
MAX_HASH = 2**64 - 1


def check_kind(kind: str) -> None:
    if kind not in EVENT_KINDS:
        raise ValueError(f"KV event kind {kind!r} is unknown: use one of {EVENT_KINDS}")


@dataclass
class EventBatch:
    """Coalesced events: block hash -> last kind seen, in first-seen order."""

    last_kind: dict[int, str] = field(default_factory=dict)

    def add(self, kind: str, block_hashes: Iterable[int]) -> None:
        check_kind(kind)
        for h in block_hashes:
            h = int(h)
            if not 0 <= h <= MAX_HASH:
                raise ValueError(f"block hash {h} is not an unsigned 64-bit int: use prefix_store.hashing")
            self.last_kind.pop(h, None)  # re-insert so order follows the last event
            self.last_kind[h] = kind

    @property
    def stored(self) -> list[int]:
        return [h for h, k in self.last_kind.items() if k == "stored"]

    @property
    def evicted(self) -> list[int]:
        return [h for h, k in self.last_kind.items() if k == "evicted"]

    def __len__(self) -> int:
        return len(self.last_kind)

    @classmethod
    def of(cls, stored: Iterable[int] = (), evicted: Iterable[int] = ()) -> "EventBatch":
        batch = cls()
        batch.add("stored", stored)
        batch.add("evicted", evicted)
        return batch

    def to_msgpack(self) -> bytes:
        """Wire form for shipping a batch between processes."""
        return msgpack.packb({"stored": self.stored, "evicted": self.evicted})

    @classmethod
    def from_msgpack(cls, data: bytes) -> "EventBatch":
        obj = msgpack.unpackb(data)
        return cls.of(stored=obj.get("stored", ()), evicted=obj.get("evicted", ()))
