"""The status board's read (pdcluster/services/pools/status_board.read_statuses),
as the gateway's pool liveness, its /metrics reader and core lending use it: the cluster's member
set and one MGET, never a SCAN of the keyspace; statuses parsed, expired keys pruned from the set
and values that are not a status skipped."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdcluster.services.gateway.liveness import PoolLiveness
from pdcluster.services.pools.status_board import read_statuses

PREFILL = {"role": "prefill", "name": "p1", "engine_alive": True}
DEAD_DECODE = {"role": "decode", "name": "d1", "engine_alive": False}


class _Redis:
    """A redis.asyncio client's SMEMBERS, MGET and EVAL over a dict (every key listed in the set)."""

    def __init__(self, values: dict[str, bytes | None]):
        self.values, self.sets, self.pruned = values, [], []

    async def smembers(self, name):
        self.sets.append(name)
        return {key.encode() for key in self.values}

    async def mget(self, keys):
        return [self.values[k.decode()] for k in keys]

    async def eval(self, script, numkeys, *keys_and_args):
        self.pruned.append(keys_and_args)

    async def hgetall(self, key):
        return {}  # no pool targets published


def _board() -> _Redis:
    return _Redis({"pdc:status:c:p1": json.dumps(PREFILL).encode(), "pdc:status:c:d1": json.dumps(DEAD_DECODE).encode(),
                   "pdc:status:c:gone": None, "pdc:status:c:odd": b"not json", "pdc:status:c:list": b"[1]"})


async def test_read_statuses_reads_the_clusters_set_and_skips_what_is_not_a_status():
    client = _board()
    assert sorted(await read_statuses(client, "c"), key=lambda s: s["name"]) == [DEAD_DECODE, PREFILL]
    assert client.sets == ["pdc:status-keys:c"]
    assert client.pruned == [("pdc:status-keys:c", b"pdc:status:c:gone")]  # only the expired key
    empty = _Redis({})
    assert await read_statuses(empty, "c") == [] and empty.pruned == []


async def test_pool_liveness_counts_replicas_whose_engine_is_alive():
    liveness = PoolLiveness("redis://unused:1/0", "c")
    liveness._client = _board()
    assert (await liveness.live("prefill"), await liveness.live("decode")) == (1, 0)


@pytest.fixture
def board_redis():
    """A real redis-server on a free loopback port, and a ``redis.asyncio`` client of it."""
    import redis.asyncio as aioredis

    from pdcluster.prefix_store.redis_server import RedisServer

    try:
        server = RedisServer().start()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    try:
        yield server, aioredis.from_url(server.url)
    finally:
        server.stop()


async def test_a_worker_that_stops_takes_its_key_off_the_board_at_once(board_redis):
    """Real redis-server: a publisher's key is on the board while it runs and gone as soon as
    it is cancelled (a replica's graceful stop), not _TTL_S later."""
    from pdcluster.services.pools.status_board import _TTL_S, publish_forever

    server, client = board_redis
    try:
        task = asyncio.create_task(publish_forever(server.url, "c", "p1", lambda: PREFILL))
        for _ in range(3000):  # a hang guard of 30 s: the first publish comes at once
            if await read_statuses(client, "c"):
                break
            await asyncio.sleep(0.01)
        assert await read_statuses(client, "c") == [PREFILL]
        assert 0 < await client.ttl("pdc:status:c:p1") <= _TTL_S
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await read_statuses(client, "c") == []  # right after the stop: no wait for the TTL
    finally:
        await client.aclose()


async def test_the_board_lists_only_its_members_and_prunes_a_replica_that_died_without_goodbye(board_redis):
    """Real redis-server: a status key that expired leaves the member set at the next read, one
    published again stays, other clusters' statuses and unrelated keys are not read."""
    import redis

    from pdcluster.services.pools.status_board import put_status, put_status_sync, read_board

    server, client = board_redis
    try:
        await client.set("pdc:status:c:stray", json.dumps(PREFILL))   # not a member: never read
        await put_status(client, "other", "o1", {"role": "decode", "name": "o1"})
        await put_status(client, "c", "p1", PREFILL, ttl_s=3600)   # stays through any stall of this machine
        put_status_sync(redis.Redis.from_url(server.url), "c", "d1", DEAD_DECODE, ttl_s=1)
        assert sorted(s["name"] for s in await read_statuses(client, "c")) == ["d1", "p1"]
        assert [s["name"] for s in read_board(server.url, "c")] == ["d1", "p1"]   # sorted by role, name
        for _ in range(300):  # a hang guard of 30 s: d1's key expires after 1 s
            if not await client.exists("pdc:status:c:d1"):
                break
            await asyncio.sleep(0.1)
        assert await read_statuses(client, "c") == [PREFILL]
        assert await client.smembers("pdc:status-keys:c") == {b"pdc:status:c:p1"}
        await put_status(client, "c", "d1", DEAD_DECODE)   # back: listed again
        assert sorted(s["name"] for s in await read_statuses(client, "c")) == ["d1", "p1"]
    finally:
        await client.aclose()
