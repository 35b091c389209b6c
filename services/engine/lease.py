"""Leases: blocks a prefill replica keeps pinned until the decode side has
pulled them (release) or the lease runs out (expire).  Whoever holds the
lease table also owns the blocks; ``release_blocks`` gives them back."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    expires_at: float  # time.monotonic() seconds


class LeaseTable:
    def __init__(self, release_blocks: Callable[[list[int]], None], default_ttl_s: float = 30.0):
        if default_ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {default_ttl_s}")
        self._release_blocks = release_blocks
        self.default_ttl_s = default_ttl_s
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0
        self.num_released = 0

    def pin(self, lease_id: str, block_ids: list[int], ttl_s: float | None = None,
            now: float | None = None) -> Lease:
        if lease_id in self._leases:
            raise KeyError(f"lease {lease_id!r} already exists")
        now = time.monotonic() if now is None else now
        lease = Lease(lease_id, tuple(block_ids), now + (ttl_s or self.default_ttl_s))
        self._leases[lease_id] = lease
        return lease

    def release(self, lease_id: str) -> bool:
        """Frees the lease's blocks; False if it was unknown or already gone."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._release_blocks(list(lease.block_ids))
        self.num_released += 1
        return True

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        gone = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        for lid in gone:
            self._release_blocks(list(self._leases.pop(lid).block_ids))
        self.num_expired += len(gone)
        return gone

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self._leases.values())
