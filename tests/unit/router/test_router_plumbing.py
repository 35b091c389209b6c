"""Routing header, replica stats, in-flight tracking, and the Serve router's
choose_replicas driven with stand-in replicas (no Ray cluster needed)."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from pdcluster.prefix_store.events import EventBatch
from pdcluster.prefix_store.index import LookupResult, make_index
from pdcluster.prefix_store.memory_index import InMemoryPrefixIndex
from pdcluster.prefix_store.worker_id import WorkerId
from pdcluster.router.inflight import InFlightTracker
from pdcluster.router.replica_stats import ReplicaStats
from pdcluster.router.routing_header import RoutingHeader, routing_header_of


# -- routing header ------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """Stands in for pdcluster.services.messages.GenerateRequest: the router reads only ``routing``."""
    routing: object = None


def test_header_is_read_by_type_from_the_calls_message():
    h = RoutingHeader((1, 2), num_prompt_tokens=40, block_size=16)
    assert routing_header_of((Message(h), "other")) == h
    assert routing_header_of((Message({"block_hashes": [1, 2]}),)) is None   # not a RoutingHeader
    assert routing_header_of((h,)) is None                                    # a header, but not a message
    assert routing_header_of(("just a prompt",)) is None
    assert routing_header_of(()) is None


def test_header_rejects_more_blocks_than_tokens():
    with pytest.raises(ValueError, match="hash full blocks only"):
        RoutingHeader((1, 2, 3), num_prompt_tokens=40, block_size=16)


# -- replica stats -------------------------------------------------------------------
def test_replica_stats_round_trip_and_tolerate_garbage():
    stats = ReplicaStats("w1", prefill_tokens_per_s=1500.0, free_kv_blocks=12, running_requests=2)
    assert ReplicaStats.from_routing_stats(stats.to_routing_stats()) == stats
    bad = ReplicaStats.from_routing_stats({"prefill_tokens_per_s": "fast", "free_kv_blocks": -3,
                                           "running_requests": None})
    assert bad == ReplicaStats()
    assert ReplicaStats.from_routing_stats(None) == ReplicaStats()


# -- in-flight -----------------------------------------------------------------------
def test_inflight_tracks_assign_move_complete_and_expiry():
    now = [0.0]
    t = InFlightTracker(ttl_s=10.0, clock=lambda: now[0])
    t.assign("q1", "a", 100)
    t.assign("q2", "a", 50)
    t.assign("q2", "b", 50)           # routing retry re-decides
    assert t.load("a") == (100, 1) and t.load("b") == (50, 1)
    t.moved("q1", "b")                # Serve sent it elsewhere
    assert t.load("a") == (0, 0) and t.load("b") == (150, 2)
    t.complete("q2")
    t.complete("unknown")
    assert t.load("b") == (100, 1)
    now[0] = 11.0                     # completion never reported: expires
    assert t.load("b") == (0, 0) and len(t) == 0


# -- the Serve router with stand-in replicas ------------------------------------------
@dataclass
class FakeReplica:
    unique_id: str
    routing_stats: dict = field(default_factory=dict)
    replica_metadata: dict = field(default_factory=dict)

    @property
    def replica_id(self):
        return SimpleNamespace(unique_id=self.unique_id)


def pending(request_id, header=None):
    """A Serve pending request whose message carries ``header`` (anything else: no header)."""
    return SimpleNamespace(args=[Message(header)], kwargs={}, routing_context=SimpleNamespace(should_backoff=False),
                           metadata=SimpleNamespace(internal_request_id=request_id))


def make_router(**kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from pdcluster.router.serve_router import PrefixAwareRequestRouter
    r = PrefixAwareRequestRouter(DeploymentID(name="prefill", app_name="t"), DeploymentHandleSource.UNKNOWN)
    r.initialize_state(**kwargs)
    return r


async def test_serve_router_routes_to_the_index_holder_and_tracks_load():
    index = InMemoryPrefixIndex()
    holder = WorkerId("w-b", 1)
    await index.register(holder, ttl_s=60)
    await index.publish(holder, EventBatch.of(stored=[11, 12, 13]))
    router = make_router(pool="prefill", index=index)
    replicas = [FakeReplica("ra", {"worker_name": "w-a", "prefill_tokens_per_s": 1000.0}),
                FakeReplica("rb", {"prefill_tokens_per_s": 1000.0}, {"worker_name": "w-b"})]
    header = RoutingHeader((11, 12, 13, 14), num_prompt_tokens=70, block_size=16)
    pr = pending("q1", header)
    ranks = await router.choose_replicas(replicas, pr)
    assert [r[0].unique_id for r in ranks] == ["rb", "ra"]
    assert pr.routing_context.should_backoff
    assert router.last_decision.reason.startswith("cache hit 48/70 tokens")
    assert router.inflight.load("rb") == (22, 1)        # only the uncached tokens queue
    router.on_request_completed(SimpleNamespace(unique_id="rb"), "q1")
    assert router.inflight.load("rb") == (0, 0)
    assert router.counters.cache_routed == 1


async def test_serve_router_prefers_a_device_hit_to_a_disk_hit_and_both_to_a_recompute():
    """Two replicas hold the prompt's blocks, one in its pool and one only in its
    disk tier: the snapshot charges the second its load time (block_load_s)."""
    index = InMemoryPrefixIndex()
    on_device, on_disk, nothing = WorkerId("w-a", 1), WorkerId("w-b", 1), WorkerId("w-c", 1)
    for w in (on_device, on_disk, nothing):
        await index.register(w, ttl_s=60)
    await index.publish(on_device, EventBatch.of(stored=[11, 12, 13]))
    await index.publish(on_disk, EventBatch.of(tiers={"disk": {"stored": [11, 12, 13]}}))
    router = make_router(pool="prefill", index=index, block_load_s={"disk": 0.01})
    replicas = [FakeReplica(r, {"worker_name": w, "prefill_tokens_per_s": 1000.0})
                for r, w in (("rc", "w-c"), ("rb", "w-b"), ("ra", "w-a"))]
    header = RoutingHeader((11, 12, 13, 14), num_prompt_tokens=70, block_size=16)
    ranks = await router.choose_replicas(replicas, pending("q1", header))
    assert [r[0].unique_id for r in ranks] == ["ra", "rb", "rc"]
    assert router.last_decision.estimated_ttft_s == pytest.approx(22 / 1000)
    snapshot = router._snapshot({r.unique_id: r for r in replicas}, header, await index.lookup(header.block_hashes))
    assert snapshot.request.tier_load_s == {"rb": pytest.approx(0.03)}


async def test_serve_router_routes_by_load_without_header_or_when_index_fails():
    class BrokenIndex(InMemoryPrefixIndex):
        async def lookup(self, block_hashes):
            return LookupResult.unavailable(len(block_hashes), "redis down")

    router = make_router(pool="prefill", index=BrokenIndex())
    replicas = [FakeReplica("ra", {"queued_prefill_tokens": 5000}), FakeReplica("rb")]
    header = RoutingHeader((1,), num_prompt_tokens=16)
    ranks = await router.choose_replicas(replicas, pending("q1", header))
    assert ranks[0][0].unique_id == "rb"
    assert router.counters.degraded_lookups == 1
    ranks = await router.choose_replicas(replicas, pending("q2", "no header"))
    assert ranks[0][0].unique_id == "rb" and router.counters.without_header == 1


async def test_decode_router_uses_free_kv_blocks():
    router = make_router(pool="decode")
    replicas = [FakeReplica("ra", {"free_kv_blocks": 4}), FakeReplica("rb", {"free_kv_blocks": 400})]
    header = RoutingHeader((1, 2), num_prompt_tokens=40, max_new_tokens=100)
    ranks = await router.choose_replicas(replicas, pending("q1", header))
    assert [r[0].unique_id for r in ranks] == ["rb", "ra"]
    assert router.inflight.load("rb") == (0, 1)


async def test_headerless_requests_spread_over_idle_replicas():
    router = make_router(pool="prefill")
    replicas = [FakeReplica(f"r{i}") for i in range(4)]
    chosen = set()
    for i in range(40):
        ranks = await router.choose_replicas(replicas, pending(f"q{i}", "no header"))
        chosen.add(ranks[0][0].unique_id)
        router.on_request_completed(SimpleNamespace(unique_id=ranks[0][0].unique_id), f"q{i}")
    assert chosen == {"r0", "r1", "r2", "r3"}


async def test_target_pins_while_prefer_falls_back_once_the_replica_is_gone():
    router = make_router(pool="prefill")
    replicas = [FakeReplica("ra", {"worker_name": "w-a"}), FakeReplica("rb", {"worker_name": "w-b"})]
    pinned = RoutingHeader((1,), num_prompt_tokens=16, target_worker="w-b")
    preferred = RoutingHeader((1,), num_prompt_tokens=16, prefer_worker="w-b")
    assert [r[0].unique_id for r in await router.choose_replicas(replicas, pending("q1", pinned))] == ["rb"]
    assert [r[0].unique_id for r in await router.choose_replicas(replicas, pending("q2", preferred))] == ["rb"]
    survivors = replicas[:1]                          # w-b died
    assert await router.choose_replicas(survivors, pending("q3", pinned)) == []
    assert [r[0].unique_id for r in await router.choose_replicas(survivors, pending("q4", preferred))] == ["ra"]


# -- admission's lookup shared with the router (prefix_store/recent_lookups.py) -----------
@pytest.fixture
def redis_url():
    from pdcluster.prefix_store.redis_server import RedisServer

    with RedisServer() as server:
        yield server.url


async def test_the_router_takes_admissions_answer_instead_of_asking_redis_again(redis_url, monkeypatch):
    from pdcluster.prefix_store.recent_lookups import RECENT_LOOKUPS
    monkeypatch.setattr(RECENT_LOOKUPS, "fresh_s", 3600.0)  # no verdict here rests on how fast the machine is
    from pdcluster.services.gateway.cached_prefix import cached_tokens

    gateway_index = make_index(redis_url, cluster="c", model="m")  # admission's, and the router's own
    holder = WorkerId("prefill-b", 1)
    await gateway_index.register(holder, ttl_s=60)
    await gateway_index.publish(holder, EventBatch.of(stored=[11, 12]))
    router = make_router(pool="prefill", index_url=redis_url, cluster="c", model="m")
    replicas = [FakeReplica("ra", {"worker_name": "prefill-a"}), FakeReplica("rb", {"worker_name": "prefill-b"})]
    header = RoutingHeader((11, 12, 13), num_prompt_tokens=60, block_size=16)

    assert await cached_tokens(gateway_index, header.block_hashes, 16, ("prefill", "prefill")) == {"prefill": 32}
    ranks = await router.choose_replicas(replicas, pending("q1", header))
    assert ranks[0][0].unique_id == "rb"
    assert (router.counters.shared_lookups, router.counters.lookups, router._index.counters.lookups) == (1, 0, 0)
    # the next placement of the same prompt (a retry, a second choice) asks Redis itself
    ranks = await router.choose_replicas(replicas, pending("q2", header))
    assert ranks[0][0].unique_id == "rb"
    assert (router.counters.shared_lookups, router.counters.lookups, router._index.counters.lookups) == (1, 1, 1)
    assert gateway_index.counters.lookups == 1
