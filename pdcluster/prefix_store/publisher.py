"""Worker side of the prefix index: turn the engine's KV events into index writes.

    engine KV cache --on_event(kind, hashes)--> publisher --batched--> index
    engine KV tiers --on_tier_event(kind, tier, hashes)--^

* ``on_event`` is the engine hook: synchronous, thread-safe, never blocks on
  or raises because of the index.  It updates the worker's own view of what
  it holds (``held_blocks``) and coalesces the event into a pending batch.
* A background task flushes the batch ``flush_interval_s`` after its first
  event (the event wakes it: an idle worker's task sleeps until then or its
  next heartbeat), heartbeats every ``heartbeat_ttl_s / 3`` and now and then
  purges dead workers' entries.
* While the index is down, events stay buffered (coalesced per block, so the
  buffer is bounded by distinct blocks).  Past ``max_pending_blocks`` the
  buffer is dropped (counted in ``events_dropped``) and the worker re-syncs
  instead: clear its entries and republish ``held_blocks`` in full.  It also
  re-syncs whenever a heartbeat finds it unregistered (index restarted, or
  its TTL lapsed and its entries may have been purged).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pdcluster.prefix_store.events import DEVICE, LOWER_TIERS, EventBatch, check_kind, check_tier
from pdcluster.prefix_store.index_base import HeartbeatStatus, IndexUnavailable, PrefixIndex
from pdcluster.prefix_store.worker_id import WorkerId

log = logging.getLogger(__name__)


@dataclass
class PublisherCounters:
    events_received: int = 0
    events_published: int = 0
    events_dropped: int = 0       # buffer overflowed; covered by the next re-sync
    flush_failures: int = 0
    heartbeats: int = 0
    heartbeat_failures: int = 0
    resyncs: int = 0
    superseded: bool = False      # a newer epoch of this worker took over; publishing stopped


class KVEventPublisher:
    def __init__(self, index: PrefixIndex, worker: WorkerId, *, heartbeat_ttl_s: float = 10.0,
                 flush_interval_s: float = 0.02, retry_interval_s: float = 1.0,
                 max_pending_blocks: int = 200_000, purge_interval_s: float = 60.0,
                 info: dict | None = None) -> None:
        if heartbeat_ttl_s <= 0 or flush_interval_s <= 0:
            raise ValueError("heartbeat_ttl_s and flush_interval_s must be > 0")
        self.index = index
        self.worker = worker
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        self.max_pending_blocks = max_pending_blocks
        self.purge_interval_s = purge_interval_s
        self.info = info or {}
        self.counters = PublisherCounters()
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._held_tiers: dict[str, set[int]] = {t: set() for t in LOWER_TIERS}  # host / disk
        self._pending = EventBatch()
        self._needs_resync = True          # the first contact publishes the full set
        self._registered = False
        self._next_heartbeat_s = 0.0
        self._next_purge_s = 0.0
        self._retry_at_s = 0.0
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None    # set (on run's loop) by the first event after ``_armed``
        self._wake_loop: asyncio.AbstractEventLoop | None = None
        self._armed = False                        # run's task sleeps: the next event must wake it

    # -- engine hook (any thread) ------------------------------------------
    def on_event(self, kind: str, block_hashes: Iterable[int]) -> None:
        self.on_tier_event(kind, DEVICE, block_hashes)

    def on_tier_event(self, kind: str, tier: str, block_hashes: Iterable[int]) -> None:
        """A block stored in or evicted from one tier (device, host or disk)."""
        check_kind(kind)
        check_tier(tier)
        hashes = [int(h) for h in block_hashes]
        held = self._held if tier == DEVICE else self._held_tiers[tier]
        with self._lock:
            self.counters.events_received += len(hashes)
            if kind == "stored":
                held.update(hashes)
            else:
                held.difference_update(hashes)
            if not self._needs_resync:  # else the re-sync publishes _held as a whole
                self._pending.add(kind, hashes, tier)
                if len(self._pending) > self.max_pending_blocks:
                    self.counters.events_dropped += len(self._pending)
                    self._pending = EventBatch()
                    self._needs_resync = True
            wake, self._armed = self._armed, False
        if wake:
            self._wake_up()

    def _wake_up(self) -> None:
        loop, event = self._wake_loop, self._wake
        if loop is None or event is None:
            return
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:
            pass  # that loop is closed: nothing left to wake

    @property
    def held_blocks(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._held)

    def held_in(self, tier: str) -> frozenset[int]:
        with self._lock:
            return frozenset(self._held if tier == DEVICE else self._held_tiers[tier])

    @property
    def sleeping(self) -> bool:
        """The background task waits for the next event or heartbeat (nothing to publish)."""
        with self._lock:
            return self._armed

    @property
    def in_sync(self) -> bool:
        with self._lock:
            return self._registered and not self._needs_resync and not len(self._pending)

    # -- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        """Runs ``run`` in a task of its own (an owner that supervises its tasks awaits ``run`` instead)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self, *, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if deregister and not self.counters.superseded:
            try:
                await self.index.deregister(self.worker)
            except IndexUnavailable as err:
                log.warning("worker %s: could not deregister (%s); its entries expire with "
                            "its heartbeat and are purged by any live worker", self.worker, err)

    async def run(self) -> None:
        """Syncs with the index until superseded (returns then) or cancelled."""
        self._wake, self._wake_loop = asyncio.Event(), asyncio.get_running_loop()
        while not self.counters.superseded:
            if time.monotonic() >= self._retry_at_s:
                await self.sync_once()
            await self._until_work()
            await asyncio.sleep(self.flush_interval_s)  # the batch gathers; no two syncs closer than this

    async def _until_work(self) -> None:
        """Returns at once when events wait (or a re-sync does); else when the
        next event arrives or the next heartbeat is due, whichever comes first."""
        with self._lock:
            if len(self._pending) or self._needs_resync:
                return
            self._armed = True
            self._wake.clear()
        try:
            async with asyncio.timeout(max(0.0, self._next_heartbeat_s - time.monotonic())):
                await self._wake.wait()
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._armed = False

    # -- one round of work ---------------------------------------------------
    async def sync_once(self, *, heartbeat: bool = False) -> bool:
        """Heartbeat if due (or if ``heartbeat``), then re-sync or flush.
        True when the index is up to date.  Never raises for index trouble."""
        if self.counters.superseded:
            return False
        if heartbeat:
            self._next_heartbeat_s = 0.0
        try:
            await self._heartbeat_if_due()
            if self.counters.superseded:
                return False
            with self._lock:
                resync = self._needs_resync
            await (self._resync() if resync else self._flush())
            if time.monotonic() >= self._next_purge_s:
                self._next_purge_s = time.monotonic() + self.purge_interval_s
                await self.index.purge_dead_workers()
        except IndexUnavailable:
            self._retry_at_s = time.monotonic() + self.retry_interval_s
            return False
        return self.in_sync

    async def _heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if self._registered and now < self._next_heartbeat_s:
            return
        try:
            if self._registered:
                status = await self.index.heartbeat(self.worker, self.heartbeat_ttl_s)
            else:
                status = await self.index.register(self.worker, self.heartbeat_ttl_s, self.info)
        except IndexUnavailable:
            self.counters.heartbeat_failures += 1
            raise
        self.counters.heartbeats += 1
        self._next_heartbeat_s = now + self.heartbeat_ttl_s / 3
        if status is HeartbeatStatus.SUPERSEDED:
            self.counters.superseded = True
            log.error("worker %s: a newer epoch of %r is live; this incarnation stops publishing "
                      "(restart the replica if that is unexpected)", self.worker, self.worker.name)
            return
        if status is HeartbeatStatus.REGISTERED and self._registered:
            log.warning("worker %s: index had forgotten this worker (restart or TTL lapse); "
                        "republishing %d blocks", self.worker, len(self._held))
            with self._lock:
                self._needs_resync = True
        self._registered = True

    async def _flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, EventBatch()
        if not len(batch):
            return
        try:
            await self.index.publish(self.worker, batch)
        except IndexUnavailable:
            self.counters.flush_failures += 1
            with self._lock:  # put it back *before* anything that arrived meanwhile
                newer, self._pending = self._pending, batch
                self._pending.merge(newer)
            raise
        self.counters.events_published += len(batch)

    async def _resync(self) -> None:
        with self._lock:
            snapshot = EventBatch.of(stored=self._held,
                                     tiers={t: {"stored": held} for t, held in self._held_tiers.items()})
            self._pending = EventBatch()
            self._needs_resync = False
        try:
            await self.index.clear_worker(self.worker)
            await self.index.publish(self.worker, snapshot)
        except IndexUnavailable:
            with self._lock:
                self._needs_resync = True
                self._pending = EventBatch()
            raise
        self.counters.resyncs += 1
        self.counters.events_published += len(snapshot)
