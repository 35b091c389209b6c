"""The prefix-index contract, run against the real Redis index (a real
redis-server) and the in-memory index alike."""

import asyncio
import time

import pytest

from pdcluster.prefix_store.events import EventBatch
from pdcluster.prefix_store.hashing import hash_prompt_blocks, model_fingerprint
from pdcluster.prefix_store.index import HeartbeatStatus
from pdcluster.prefix_store.memory_index import InMemoryPrefixIndex
from pdcluster.prefix_store.publisher import KVEventPublisher
from pdcluster.prefix_store.redis_index import RedisPrefixIndex
from pdcluster.prefix_store.worker_id import WorkerId

H = [1000 + i for i in range(8)]  # h0..h7


@pytest.fixture(params=["memory", "redis"])
def make_index(request, unique_model):
    """Builds indexes of one kind; the test closes them (clients live on its loop)."""

    def make(model=unique_model):
        if request.param == "memory":
            return InMemoryPrefixIndex()
        server = request.getfixturevalue("redis_server")
        return RedisPrefixIndex(server.url, cluster="test", model=model, lookup_timeout_s=0.5)

    return make


@pytest.fixture
async def index(make_index):
    idx = make_index()
    yield idx
    await idx.close()


async def live(index, *workers, ttl_s=30.0):
    for w in workers:
        assert await index.register(w, ttl_s) in (HeartbeatStatus.REGISTERED, HeartbeatStatus.RENEWED)


async def test_lookup_gives_exact_leading_match_lengths(index):
    w1, w2, w3 = WorkerId("w1", 1), WorkerId("w2", 1), WorkerId("w3", 1)
    await live(index, w1, w2, w3)
    await index.publish(w1, EventBatch.of(stored=H[:6]))
    await index.publish(w2, EventBatch.of(stored=H[:3]))
    await index.publish(w3, EventBatch.of(stored=H[1:6]))        # lacks h0: never a leading match
    assert (await index.lookup(H)).matched_blocks == {"w1": 6, "w2": 3}
    assert (await index.lookup(H[1:])).matched_blocks == {"w1": 5, "w2": 2, "w3": 5}
    await index.publish(w1, EventBatch.of(evicted=[H[2]]))       # a hole cuts the match
    assert (await index.lookup(H)).matched_blocks == {"w1": 2, "w2": 3}
    assert (await index.lookup([H[0]])).matched_blocks == {"w1": 1, "w2": 1}
    assert (await index.lookup([])).matched_blocks == {}
    result = await index.lookup([7, 8])
    assert result.matched_blocks == {} and not result.degraded


async def test_real_prompt_hashes_share_their_common_prefix(index):
    seed = model_fingerprint("contract", 4)
    system = list(range(12))                                     # 3 blocks of 4
    a = hash_prompt_blocks(seed, system + [50, 51, 52, 53, 54], 4)
    b = hash_prompt_blocks(seed, system + [60, 61, 62, 63], 4)
    w = WorkerId("w", 7)
    await live(index, w)
    await index.publish(w, EventBatch.of(stored=a))
    assert (await index.lookup(b)).matched_blocks == {"w": 3}
    assert (await index.lookup(a)).matched_blocks == {"w": 4}


async def test_lapsed_heartbeat_stops_matching_within_ttl(index):
    lapsing, beating = WorkerId("lapsing", 1), WorkerId("beating", 1)
    await index.register(lapsing, ttl_s=0.3)
    await index.register(beating, ttl_s=0.3)
    for w in (lapsing, beating):
        await index.publish(w, EventBatch.of(stored=H[:2]))
    assert (await index.lookup(H[:2])).matched_blocks == {"lapsing": 2, "beating": 2}
    t0 = time.monotonic()
    for _ in range(3):
        await asyncio.sleep(0.15)
        assert await index.heartbeat(beating, ttl_s=0.3) is HeartbeatStatus.RENEWED
    assert time.monotonic() - t0 >= 0.3
    assert (await index.lookup(H[:2])).matched_blocks == {"beating": 2}
    # coming back after the lapse counts as a fresh registration: republish
    assert await index.heartbeat(lapsing, ttl_s=0.3) is HeartbeatStatus.REGISTERED


async def test_restarted_worker_does_not_inherit_old_entries(index):
    old, new = WorkerId("w", 1), WorkerId("w", 2)
    await live(index, old)
    await index.publish(old, EventBatch.of(stored=H[:4]))
    assert await index.register(new, ttl_s=30) is HeartbeatStatus.TOOK_OVER
    assert (await index.lookup(H[:4])).matched_blocks == {}
    await index.publish(new, EventBatch.of(stored=H[:1]))
    assert (await index.lookup(H[:4])).matched_blocks == {"w": 1}
    assert await index.live_workers() == [new]
    assert await index.heartbeat(old, ttl_s=30) is HeartbeatStatus.SUPERSEDED
    await index.publish(old, EventBatch.of(stored=H[:4]))    # a zombie's late writes never count
    assert (await index.lookup(H[:4])).matched_blocks == {"w": 1}


async def test_dead_workers_entries_are_purged_and_live_ones_kept(index):
    dead, alive = WorkerId("dead", 1), WorkerId("alive", 1)
    await index.register(dead, ttl_s=0.1)
    await live(index, alive)
    await index.publish(dead, EventBatch.of(stored=H[:5]))
    await index.publish(alive, EventBatch.of(stored=H[:2]))
    await asyncio.sleep(0.2)
    assert await index.live_workers() == [alive]
    report = await index.purge_dead_workers()
    assert report.workers_purged == ["dead@1"] and report.blocks_removed == 5
    assert (await index.purge_dead_workers()).blocks_removed == 0
    assert (await index.lookup(H)).matched_blocks == {"alive": 2}
    await index.register(dead, ttl_s=30)                     # back, but its entries are gone
    assert (await index.lookup(H)).matched_blocks == {"alive": 2}


async def test_deregister_stops_matching_at_once(index):
    w = WorkerId("w", 1)
    await live(index, w)
    await index.publish(w, EventBatch.of(stored=H[:3]))
    assert await index.clear_worker(w) == 3          # a live worker's own reset
    assert await index.live_workers() == [w]
    await index.publish(w, EventBatch.of(stored=H[:3]))
    await index.deregister(w)
    assert await index.live_workers() == []
    assert (await index.lookup(H)).matched_blocks == {}
    assert await index.clear_worker(w) == 0


async def test_models_do_not_share_entries(make_index):
    a, b = make_index("model-a"), make_index("model-b")
    w = WorkerId("w", 1)
    try:
        await live(a, w)
        await live(b, w)
        await a.publish(w, EventBatch.of(stored=H[:2]))
        assert (await a.lookup(H)).matched_blocks == {"w": 2}
        assert (await b.lookup(H)).matched_blocks == {}
    finally:
        await a.close()
        await b.close()


async def test_publisher_feeds_the_index_end_to_end(index):
    pub = KVEventPublisher(index, WorkerId("engine-0", 3), heartbeat_ttl_s=5.0)
    pub.on_event("stored", H[:4])
    pub.on_event("evicted", [H[3]])
    assert await pub.sync_once()
    assert (await index.lookup(H)).matched_blocks == {"engine-0": 3}
    await pub.stop()
    assert (await index.lookup(H)).matched_blocks == {}


async def test_lookup_counts_blocks_in_lower_tiers_and_their_removal(index):
    """A block a worker holds only in its host or disk tier still extends its
    match (it costs a load, not a recompute), and ``tier_blocks`` says how many
    of the leading blocks are there; evicting from a tier removes that entry."""
    w1, w2 = WorkerId("w1", 1), WorkerId("w2", 1)
    await live(index, w1, w2)
    await index.publish(w1, EventBatch.of(stored=H[:2], tiers={"host": {"stored": H[2:4]},
                                                              "disk": {"stored": H[4:6]}}))
    await index.publish(w2, EventBatch.of(tiers={"disk": {"stored": H[:3]}}))  # nothing on its device
    result = await index.lookup(H)
    assert result.matched_blocks == {"w1": 6, "w2": 3}
    assert result.tier_blocks == {"w1": {"host": 2, "disk": 2}, "w2": {"disk": 3}}
    assert result.device_blocks("w1") == 2 and result.device_blocks("w2") == 0
    await index.publish(w1, EventBatch.of(stored=[H[2]], tiers={"host": {"evicted": [H[3]]}}))  # loaded back; one gone
    result = await index.lookup(H)
    assert result.matched_blocks == {"w1": 3, "w2": 3} and result.tier_blocks == {"w2": {"disk": 3}}
    await index.clear_worker(w2)  # tier entries go with the rest
    result = await index.lookup(H)
    assert result.matched_blocks == {"w1": 3} and result.tier_blocks == {}


async def test_publisher_republishes_every_tier_after_a_resync(index):
    w = WorkerId("engine", 1)
    pub = KVEventPublisher(index, w, flush_interval_s=0.01)
    pub.on_event("stored", H[:2])
    pub.on_tier_event("stored", "host", H[2:4])
    assert await pub.sync_once()
    await index.clear_worker(w)  # the index lost them (say, a restart)
    pub._needs_resync = True
    assert await pub.sync_once()
    result = await index.lookup(H[:4])
    assert result.matched_blocks == {"engine": 4} and result.tier_blocks == {"engine": {"host": 2}}
    assert pub.held_in("host") == frozenset(H[2:4])
    await pub.stop()
