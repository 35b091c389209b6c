"""The worker-side publisher against the in-memory index, with outages
simulated by a wrapper that refuses writes."""

import asyncio
import threading

import pytest

from pdcluster.prefix_store.index import IndexUnavailable, PrefixIndex
from pdcluster.prefix_store.memory_index import InMemoryPrefixIndex
from pdcluster.prefix_store.publisher import KVEventPublisher
from pdcluster.prefix_store.worker_id import WorkerId


class Switchable(PrefixIndex):
    """Forwards to ``inner``; while ``down`` every write raises IndexUnavailable."""

    def __init__(self):
        self.inner = InMemoryPrefixIndex()
        self.down = False
        self.counters = self.inner.counters

    def _up(self):
        if self.down:
            raise IndexUnavailable("index down (test)")
        return self.inner

    async def register(self, worker, ttl_s, info=None):
        return await self._up().register(worker, ttl_s, info)

    async def heartbeat(self, worker, ttl_s):
        return await self._up().heartbeat(worker, ttl_s)

    async def deregister(self, worker):
        return await self._up().deregister(worker)

    async def publish(self, worker, batch):
        return await self._up().publish(worker, batch)

    async def clear_worker(self, worker):
        return await self._up().clear_worker(worker)

    async def purge_dead_workers(self):
        return await self._up().purge_dead_workers()

    async def live_workers(self):
        return await self._up().live_workers()

    async def lookup(self, block_hashes):
        return await self.inner.lookup(block_hashes)


@pytest.fixture
def index():
    return Switchable()


async def matches(index, hashes):
    return (await index.lookup(hashes)).matched_blocks


async def test_events_reach_the_index_in_order(index):
    pub = KVEventPublisher(index, WorkerId("w", 1))
    pub.on_event("stored", [1, 2, 3, 4])
    assert await pub.sync_once()
    assert await matches(index, [1, 2, 3, 4, 5]) == {"w": 4}
    pub.on_event("evicted", [3])
    pub.on_event("stored", [5])
    assert await pub.sync_once()
    assert await matches(index, [1, 2, 3, 4, 5]) == {"w": 2}
    assert pub.held_blocks == {1, 2, 4, 5}
    assert pub.counters.events_received == 6 and pub.in_sync


async def test_outage_buffers_events_then_delivers_them(index):
    pub = KVEventPublisher(index, WorkerId("w", 1))
    assert await pub.sync_once()
    index.down = True
    pub.on_event("stored", [1, 2])
    assert not await pub.sync_once()
    pub.on_event("stored", [3])
    assert not await pub.sync_once()
    assert pub.counters.flush_failures == 2 and pub.counters.events_dropped == 0
    index.down = False
    assert await pub.sync_once()
    assert await matches(index, [1, 2, 3]) == {"w": 3}


async def test_overflow_drops_with_a_counter_and_resyncs_the_full_set(index):
    pub = KVEventPublisher(index, WorkerId("w", 1), max_pending_blocks=3)
    pub.on_event("stored", [9])
    assert await pub.sync_once()
    index.down = True
    pub.on_event("stored", [1, 2, 3])
    pub.on_event("evicted", [9])          # 4 distinct blocks pending > 3: dropped
    pub.on_event("stored", [4])
    assert pub.counters.events_dropped == 4
    assert not await pub.sync_once()
    index.down = False
    assert await pub.sync_once()
    assert pub.counters.resyncs == 2      # the first contact, then the recovery
    assert await matches(index, [1, 2, 3, 4]) == {"w": 4}
    assert await matches(index, [9]) == {}


async def test_index_restart_is_noticed_by_heartbeat_and_republished(index):
    pub = KVEventPublisher(index, WorkerId("w", 1))
    pub.on_event("stored", [1, 2, 3])
    assert await pub.sync_once()
    index.inner = InMemoryPrefixIndex()   # Redis restarted empty
    assert await matches(index, [1, 2, 3]) == {}
    assert await pub.sync_once(heartbeat=True)
    assert await matches(index, [1, 2, 3]) == {"w": 3}


async def test_a_newer_epoch_supersedes_the_old_publisher(index):
    old = KVEventPublisher(index, WorkerId("w", 1))
    old.on_event("stored", [1, 2])
    assert await old.sync_once()
    new = KVEventPublisher(index, WorkerId("w", 2))
    new.on_event("stored", [1])
    assert await new.sync_once()
    assert await matches(index, [1, 2]) == {"w": 1}   # the old epoch's [1, 2] does not count
    assert not await old.sync_once(heartbeat=True)
    assert old.counters.superseded
    await old.stop()                                   # must not deregister the new epoch
    assert await matches(index, [1, 2]) == {"w": 1}


async def test_stop_deregisters(index):
    pub = KVEventPublisher(index, WorkerId("w", 1), flush_interval_s=0.01)
    await pub.start()
    pub.on_event("stored", [1, 2])
    assert await pub.sync_once()
    await pub.stop()
    assert await matches(index, [1, 2]) == {}


async def test_on_event_is_safe_from_engine_threads(index):
    pub = KVEventPublisher(index, WorkerId("w", 1))
    threads = [threading.Thread(target=lambda k=k: [pub.on_event("stored", [k * 1000 + i]) for i in range(500)])
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert await pub.sync_once()
    assert len(pub.held_blocks) == 2000 and pub.counters.events_received == 2000
    assert await matches(index, [3499]) == {"w": 1}


async def _until(condition, what: str, limit_s: float = 30.0):
    for _ in range(int(limit_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"not {what} within {limit_s} s")


async def test_an_idle_publisher_sleeps_until_an_event_wakes_it(index):
    """No 50 Hz polling while nothing happens: the task syncs once after its
    first contact, then only when an event (here from another thread) arrives."""
    pub = KVEventPublisher(index, WorkerId("w", 1), heartbeat_ttl_s=3000.0, flush_interval_s=0.001)
    syncs = []
    real_sync = pub.sync_once

    async def counted(**kwargs):
        syncs.append(kwargs)
        return await real_sync(**kwargs)

    pub.sync_once = counted
    await pub.start()
    try:
        await _until(lambda: pub.sleeping and pub.in_sync, "asleep after the first contact")
        first = len(syncs)
        for _ in range(40):               # ~100 syncs' worth of the old 1 ms cadence
            await asyncio.sleep(0.0025)
        assert len(syncs) == first and pub.sleeping
        worker = threading.Thread(target=pub.on_event, args=("stored", [7, 8]))
        worker.start()
        worker.join()
        await _until(lambda: pub.sleeping and pub.in_sync and len(syncs) > first, "woken and asleep again")
        assert len(syncs) == first + 1
        assert await matches(index, [7, 8]) == {"w": 2}
    finally:
        await pub.stop()
