"""A real Serve app (three dummy prefill replicas, no model) routed by
PrefixAwareRequestRouter against the session's redis-server: requests whose
prefix the index places on a replica go to that replica, even when plain
tie-breaking would have picked another."""

import asyncio
import random
from types import SimpleNamespace

import pytest

from pdcluster.prefix_store.events import EventBatch
from pdcluster.prefix_store.redis_index import RedisPrefixIndex
from pdcluster.prefix_store.worker_id import WorkerId
from pdcluster.router.routing_header import RoutingHeader
from pdcluster.router.serve_router import request_router_config
from pdcluster.router.snapshot import affinity_rank

pytestmark = pytest.mark.integration
BLOCK = 16
STATS_RATE, STATS_FREE_KV = 1000.0, 64  # every replica's routing stats


def build_app(index_url: str, model: str):
    from ray import serve

    @serve.deployment(num_replicas=3, max_ongoing_requests=4, ray_actor_options={"num_cpus": 0},
                      request_router_config=request_router_config(
                          "prefill", index_url=index_url, cluster="test", model=model,
                          stats_period_s=0.5, lookup_timeout_s=2.0,  # a loaded CI machine: no fallback
                          # what the replicas report, so a replica whose stats have not reached the
                          # router yet looks the same as one whose have: ties stay ties (issue 39)
                          default_prefill_tokens_per_s=STATS_RATE, default_free_kv_blocks=STATS_FREE_KV))
    class FakePrefill:
        async def __init__(self, index_url: str, model: str):
            from pdcluster.prefix_store.index import make_index
            from pdcluster.prefix_store.publisher import KVEventPublisher
            self.name = serve.get_replica_context().replica_id.unique_id
            self.publisher = KVEventPublisher(make_index(index_url, cluster="test", model=model),
                                              WorkerId.new(self.name), heartbeat_ttl_s=30.0)
            assert await self.publisher.sync_once(), "replica could not register in the index"
            await self.publisher.start()

        def record_routing_stats(self) -> dict:
            from pdcluster.router.replica_stats import ReplicaStats
            return ReplicaStats(worker_name=self.name, prefill_tokens_per_s=STATS_RATE,
                                free_kv_blocks=STATS_FREE_KV).to_routing_stats()

        def record_replica_metadata(self) -> dict:
            return {"worker_name": self.name}

        async def __call__(self, request: SimpleNamespace) -> str:
            # what an engine does after prefill: report the blocks it now caches
            self.publisher.on_event("stored", list(request.routing.block_hashes))
            await self.publisher.sync_once()
            return self.name

    return FakePrefill.bind(index_url, model)


async def live_workers(url: str, model: str) -> list[WorkerId]:
    index = RedisPrefixIndex(url, cluster="test", model=model)
    try:
        return await index.live_workers()
    finally:
        await index.close()


async def publish_as(url: str, model: str, worker: WorkerId, hashes: list[int]) -> None:
    index = RedisPrefixIndex(url, cluster="test", model=model)
    try:
        await index.publish(worker, EventBatch.of(stored=hashes))
    finally:
        await index.close()


def request_for(prefix: list[int], rng: random.Random) -> SimpleNamespace:
    """A stand-in for GenerateRequest: the router reads only its ``routing``."""
    hashes = prefix + [rng.getrandbits(64) for _ in range(2)]
    return SimpleNamespace(routing=RoutingHeader(tuple(hashes), num_prompt_tokens=len(hashes) * BLOCK + 5),
                           prompt_token_ids="(elided)")


def test_cached_prefix_goes_to_the_replica_the_index_names(shared_ray, redis_server, unique_model):
    from ray import serve

    try:  # on the run's shared Ray (tests/integration/conftest.py)
        serve.start(proxy_location="Disabled")
        handle = serve.run(build_app(redis_server.url, unique_model), name="prefix-router-test",
                           route_prefix=None)
        workers = asyncio.run(live_workers(redis_server.url, unique_model))
        assert len(workers) == 3, f"expected 3 registered replicas, index has {workers}"
        names = [w.name for w in workers]
        rng = random.Random(4)

        # control, first while nothing is in flight: an unindexed prefix goes where
        # tie-breaking says (later, a completion still in flight may tip it)
        fresh = [rng.getrandbits(64) for _ in range(6)]
        expected = min(names, key=lambda n: affinity_rank(fresh[0], n))
        assert handle.remote(request_for(fresh, rng)).result(timeout_s=30) == expected

        for _ in range(4):
            prefix = [rng.getrandbits(64) for _ in range(6)]
            by_preference = sorted(workers, key=lambda w: affinity_rank(prefix[0], w.name))
            holder = by_preference[-1]          # the replica tie-breaking would pick last
            asyncio.run(publish_as(redis_server.url, unique_model, holder, prefix))
            served_by = [handle.remote(request_for(prefix, rng)).result(timeout_s=30) for _ in range(3)]
            assert served_by == [holder.name] * 3
    finally:
        serve.delete("prefix-router-test")  # Serve's controller stays for the clusters after it
