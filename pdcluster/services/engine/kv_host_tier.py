"""The host-memory tier: evicted full blocks, byte for byte, in a bounded
arena of slots, least recently used first out.

On a CPU the device pool is host memory too, so a block reaches this tier
by one copy (``block_bytes``, tens of microseconds) where the pool evicts
it; the bytes keep the pool's dtype (an 8-bit block stays 8-bit, its scales
with it).  A slot is one block::

    arena[capacity + write_back, block_bytes]   uint8
    index   hash -> (slot, tokens)              at most capacity, oldest first (the LRU end spills to disk)

A slot that a worker thread still reads (a load into the pool, a write to
disk) is pinned: it leaves the index when evicted but is reused only once
its last reader is done, so a read never sees another block's bytes.  The
``write_back`` slots beyond the capacity hold blocks on their way to disk:
a burst of evictions spills that many blocks before a write must land.
Only the engine thread calls this class; workers touch ``arena`` rows it
pinned for them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HostEntry:
    slot: int
    tokens: tuple[int, ...]


class HostTier:
    def __init__(self, capacity: int, block_bytes: int, write_back: int = 0):
        if capacity < 1:
            raise ValueError(f"the host tier needs room for at least one block, got {capacity}: "
                             "raise kv_tiers.host_bytes")
        self.block_bytes = block_bytes
        self.capacity = capacity
        self.num_slots = num_slots = capacity + write_back
        # np.empty only reserves address space: pages are touched as blocks land.
        self.arena = np.empty((num_slots, block_bytes), dtype=np.uint8)
        self._free: deque[int] = deque(range(num_slots))
        self._index: OrderedDict[int, HostEntry] = OrderedDict()  # oldest first
        self._pins = [0] * num_slots
        self._unlisted: set[int] = set()  # slots out of the index, waiting for their readers

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def is_full(self) -> bool:
        return len(self._index) >= self.capacity

    def get(self, block_hash: int) -> HostEntry | None:
        return self._index.get(block_hash)

    def touch(self, block_hash: int) -> None:
        if block_hash in self._index:
            self._index.move_to_end(block_hash)

    def put(self, block_hash: int, tokens: tuple[int, ...], src: np.ndarray) -> HostEntry | None:
        """Copies one block in (newest); None when the tier is full (spill first)
        or every spare slot is pinned by I/O."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return self._index[block_hash]
        if self.is_full or not self._free:
            return None
        slot = self._free.popleft()
        np.copyto(self.arena[slot], src)
        entry = HostEntry(slot, tokens)
        self._index[block_hash] = entry
        return entry

    def oldest(self) -> tuple[int, HostEntry] | None:
        return next(iter(self._index.items()), None)

    def remove(self, block_hash: int) -> HostEntry | None:
        """Takes a block out of the index; its slot frees once no reader holds it."""
        entry = self._index.pop(block_hash, None)
        if entry is not None:
            self._unlisted.add(entry.slot)
            self._release_if_idle(entry.slot)
        return entry

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        if self._pins[slot] <= 0:
            raise ValueError(f"host slot {slot} unpinned more often than pinned")
        self._pins[slot] -= 1
        self._release_if_idle(slot)

    def _release_if_idle(self, slot: int) -> None:
        if self._pins[slot] == 0 and slot in self._unlisted:
            self._unlisted.discard(slot)
            self._free.append(slot)

    def check_integrity(self) -> None:
        listed = {e.slot for e in self._index.values()}
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate slot in the host tier's free list"
        assert not listed & free and not listed & self._unlisted and not free & self._unlisted
        assert len(listed) == len(self._index), "two hashes share a host slot"
        assert listed | free | self._unlisted == set(range(self.num_slots)), "a host slot is lost"
        assert all(self._pins[s] > 0 for s in self._unlisted), "an unpinned slot waits for readers"
