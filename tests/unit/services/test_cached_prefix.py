"""What admission learns from the prefix index (pdcluster/services/gateway/cached_prefix.py):
the place whose router follows the cache counts its best match, the decode place (routed by free KV)
what every live decode replica holds, a degraded or failing index predicts the prompt whole, and a
real in-process index answers with a replica's blocks."""

from __future__ import annotations

import asyncio

from pdcluster.prefix_store.events import EventBatch
from pdcluster.prefix_store.index import LookupResult
from pdcluster.prefix_store.memory_index import InMemoryPrefixIndex
from pdcluster.prefix_store.worker_id import WorkerId
from pdcluster.services.gateway.cached_prefix import cache_routed_place, cached_by_place, cached_tokens
from pdcluster.services.gateway.placement import DECODE, PREFILL


def test_only_the_cache_routed_place_counts_and_the_best_replica_of_its_role():
    lookup = LookupResult({"prefill-a": 3, "prefill-b": 5, "decode-c": 9, "colocated-d": 7}, 10)
    assert cached_by_place(lookup, 16, cache_routed_place("disaggregated", "cache_aware")) == {PREFILL: 80}
    assert cached_by_place(lookup, 16, cache_routed_place("colocated", "cache_aware")) == {DECODE: 112}
    assert cached_by_place(lookup, 16, cache_routed_place("disaggregated", "least_loaded")) == {}
    assert cached_by_place(LookupResult({"decode-c": 9}, 10), 16, ("prefill", PREFILL)) == {}
    assert cached_by_place(LookupResult.unavailable(10, "down"), 16, ("prefill", PREFILL)) == {}


def test_the_decode_place_counts_what_every_live_decode_replica_holds():
    routed = cache_routed_place("disaggregated", "cache_aware")
    lookup = LookupResult({"prefill-a": 3, "decode-b": 9, "decode-c": 6}, 10)
    assert cached_by_place(lookup, 16, routed, decode_live=1) == {PREFILL: 48, DECODE: 96}  # index lags: least
    assert cached_by_place(lookup, 16, routed, decode_live=2) == {PREFILL: 48, DECODE: 96}
    assert cached_by_place(lookup, 16, routed, decode_live=3) == {PREFILL: 48}  # a third holds none of it
    assert cached_by_place(lookup, 16, routed, decode_live=None) == {PREFILL: 48}  # liveness unknown
    assert cached_by_place(LookupResult({"decode-b": 9}, 10), 16, routed, decode_live=1) == {DECODE: 144}
    # colocated: one place, the cache-routed one, as before
    assert cached_by_place(lookup, 16, cache_routed_place("colocated", "cache_aware"), decode_live=1) == {}


class _Failing:
    async def lookup(self, block_hashes):
        raise ConnectionError("redis went away")


def test_a_failing_index_predicts_the_prompt_whole():
    assert asyncio.run(cached_tokens(_Failing(), (1, 2, 3), 16, ("prefill", PREFILL))) == {}
    assert asyncio.run(cached_tokens(None, (1, 2, 3), 16, ("prefill", PREFILL))) == {}


def test_a_real_index_answers_with_the_leading_blocks_a_live_replica_published():
    index = InMemoryPrefixIndex()

    async def go():
        for name, hashes in (("prefill-x", [11, 12, 13]), ("decode-y", [11, 12, 13, 14])):
            wid = WorkerId(name, 1)
            await index.register(wid, ttl_s=60.0)
            batch = EventBatch()
            batch.add("stored", hashes)
            await index.publish(wid, batch)
        return (await cached_tokens(index, (11, 12, 13, 14), 16, ("prefill", PREFILL)),
                await cached_tokens(index, (99, 12, 13), 16, ("prefill", PREFILL)))

    assert asyncio.run(go()) == ({PREFILL: 48}, {})  # leading blocks only: a miss on the first is none
