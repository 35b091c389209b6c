"""Leases: blocks a prefill replica keeps pinned until the decode side has
pulled them (release) or the lease runs out (expire).  Whoever holds the
lease table also owns the blocks; ``release_blocks`` gives them back.

One lease's life (``expires_at`` on the monotonic clock; ``deadline_unix``
is the same instant on the wall clock, which the puller checks against)::

    pin ──── reads allowed ────┤ expires_at ├─── grace ───┤ expire() frees the blocks
                                 reads refused

    begin_read ─ blocks stay pinned ─ end_read
        a release() or expiry during a read only marks the lease gone (new
        reads are refused at once); its blocks are freed by the first
        expire() after the last end_read.

The grace covers a puller that never asks (a one-sided RDMA read): it
trusts its bytes only if they landed before ``deadline_unix`` by its own
clock, and the blocks stay unrecycled for ``expiry_grace_s`` more, so a
clock skew below the grace cannot make it read another request's K/V.

Threads: pin, release, shorten and expire run on the engine thread (they
free blocks, and the KV cache is not thread-safe); begin_read and end_read
run on the block server's threads and never free anything.  One lock
guards the table; ``release_blocks`` is called outside it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

# Blocks are freed this long after a lease's deadline (pdcluster.transfer.lease_guard.OWNER_FREE_GRACE_S).
EXPIRY_GRACE_S = 1.0


@dataclass(frozen=True)
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    expires_at: float     # time.monotonic(): reads are refused from here on
    deadline_unix: float  # the same instant as time.time(), for the puller's clock


class LeaseTable:
    def __init__(self, release_blocks: Callable[[list[int]], None], default_ttl_s: float = 30.0,
                 expiry_grace_s: float = EXPIRY_GRACE_S):
        if not default_ttl_s > 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {default_ttl_s}")
        if not expiry_grace_s >= 0:
            raise ValueError(f"lease expiry grace must be >= 0 seconds, got {expiry_grace_s}")
        self._release_blocks = release_blocks
        self.default_ttl_s = default_ttl_s
        self.expiry_grace_s = expiry_grace_s
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._readers: Counter[str] = Counter()  # lease id -> reads in progress
        # Blocks of leases released or expired while being read, by lease id:
        # freed once the id's last reader is done (a re-pinned id waits too).
        self._draining: dict[str, list[tuple[int, ...]]] = {}
        self._freeable: list[tuple[int, ...]] = []  # readers done: the next expire() frees them
        self._num_held = 0  # block references held: live leases, draining and freeable ones
        self.num_expired = 0
        self.num_refused_reads = 0
        self._pin_listeners: list[Callable[[], None]] = []  # add_pin_listener

    # ---- the engine thread ------------------------------------------------
    def add_pin_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` runs after every pin, on the pinning thread (a transfer owner's idle
        ticker wakes for the pull that follows: pdcluster/transfer/nixl_backend.py)."""
        self._pin_listeners.append(listener)

    def pin(self, lease_id: str, block_ids: list[int], ttl_s: float | None = None,
            now: float | None = None) -> Lease:
        ttl_s = ttl_s or self.default_ttl_s
        lease = self._lease(lease_id, tuple(block_ids), ttl_s, now)
        with self._lock:
            if lease_id in self._leases:
                raise KeyError(f"lease {lease_id!r} already exists")
            self._leases[lease_id] = lease
            self._num_held += len(lease.block_ids)
        for listener in self._pin_listeners:
            listener()
        return lease

    def shorten(self, lease_id: str, ttl_s: float, now: float | None = None) -> Lease | None:
        """Makes the lease end ``ttl_s`` from now if that is sooner than it
        would; returns it (None if unknown).  A test hook for short leases."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return None
            sooner = self._lease(lease_id, lease.block_ids, ttl_s, now)
            if sooner.expires_at < lease.expires_at:
                lease = self._leases[lease_id] = replace(
                    lease, expires_at=sooner.expires_at, deadline_unix=sooner.deadline_unix)
            return lease

    def release(self, lease_id: str) -> bool:
        """Frees the lease's blocks (once nobody reads them); False if it
        was unknown or already gone."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            blocks = self._retire(lease)
            self._num_held -= len(blocks)
        if blocks:
            self._release_blocks(list(blocks))
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Ends the leases whose grace is over and frees every block whose
        last reader has left; returns the ids of the leases it ended."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [lid for lid, lease in self._leases.items() if lease.expires_at + self.expiry_grace_s <= now]
            to_free = [self._retire(self._leases.pop(lid)) for lid in gone] + self._freeable
            self._freeable = []
            self.num_expired += len(gone)
            self._num_held -= sum(len(blocks) for blocks in to_free)
        for blocks in to_free:
            if blocks:
                self._release_blocks(list(blocks))
        return gone

    # ---- the block server's threads --------------------------------------------
    def begin_read(self, lease_id: str, block_ids: Sequence[int], now: float | None = None) -> str | None:
        """None: the read may go ahead, and the blocks stay pinned until
        ``end_read(lease_id)``; otherwise why it may not."""
        now = time.monotonic() if now is None else now
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                reason = "unknown or already released lease"
            elif now >= lease.expires_at:
                reason = f"lease expired {now - lease.expires_at:.3f} s ago"
            else:
                outside = sorted(set(block_ids) - set(lease.block_ids))
                reason = f"blocks {outside[:8]} are not in the lease" if outside else None
            if reason is None:
                self._readers[lease_id] += 1
            else:
                self.num_refused_reads += 1
            return reason

    def end_read(self, lease_id: str) -> None:
        """The read that ``begin_read`` allowed is over (done or failed)."""
        with self._lock:
            left = self._readers[lease_id] - 1
            if left < 0:
                raise ValueError(f"end_read({lease_id!r}) without a begin_read that allowed it")
            if left:
                self._readers[lease_id] = left
                return
            del self._readers[lease_id]
            self._freeable += self._draining.pop(lease_id, [])

    # ---- views --------------------------------------------------------------
    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks the table still holds: live leases, and gone ones still read."""
        return self._num_held

    def held_block_ids(self) -> list[int]:
        """Every block reference the table holds (a block twice if held twice)."""
        with self._lock:
            held = [lease.block_ids for lease in self._leases.values()] + self._freeable
            held += [blocks for parts in self._draining.values() for blocks in parts]
        return [b for blocks in held for b in blocks]

    # ---- helpers (under the lock) ----------------------------------------------
    def _lease(self, lease_id: str, block_ids: tuple[int, ...], ttl_s: float, now: float | None) -> Lease:
        if not 0 < ttl_s < float("inf"):
            raise ValueError(f"lease ttl must be a finite number of seconds > 0, got {ttl_s!r}")
        mono = time.monotonic()
        at = (mono if now is None else now) + ttl_s
        return Lease(lease_id, block_ids, at, time.time() + (at - mono))

    def _retire(self, lease: Lease) -> tuple[int, ...]:
        """A lease leaves the table: its blocks, or () if they must wait for readers."""
        if self._readers[lease.lease_id]:
            self._draining.setdefault(lease.lease_id, []).append(lease.block_ids)
            return ()
        return lease.block_ids
