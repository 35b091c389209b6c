"""The status board's one scan (pdcluster/services/pools/status_board.read_statuses),
as the gateway's pool liveness and /metrics reader use it: statuses parsed,
expired keys and values that are not a status skipped."""

from __future__ import annotations

import json

from pdcluster.services.gateway.liveness import PoolLiveness
from pdcluster.services.pools.status_board import read_statuses

PREFILL = {"role": "prefill", "name": "p1", "engine_alive": True}
DEAD_DECODE = {"role": "decode", "name": "d1", "engine_alive": False}


class _Redis:
    """A redis.asyncio client's SCAN and MGET over a dict."""

    def __init__(self, values: dict[str, bytes | None]):
        self.values, self.patterns = values, []

    async def scan_iter(self, pattern):
        self.patterns.append(pattern)
        for key in self.values:
            yield key.encode()

    async def mget(self, keys):
        return [self.values[k.decode()] for k in keys]

    async def hgetall(self, key):
        return {}  # no pool targets published


def _board() -> _Redis:
    return _Redis({"pdc:status:c:p1": json.dumps(PREFILL).encode(), "pdc:status:c:d1": json.dumps(DEAD_DECODE).encode(),
                   "pdc:status:c:gone": None, "pdc:status:c:odd": b"not json", "pdc:status:c:list": b"[1]"})


async def test_read_statuses_scans_the_clusters_keys_and_skips_what_is_not_a_status():
    client = _board()
    assert await read_statuses(client, "c") == [PREFILL, DEAD_DECODE]
    assert client.patterns == ["pdc:status:c:*"]
    assert await read_statuses(_Redis({}), "c") == []


async def test_pool_liveness_counts_replicas_whose_engine_is_alive():
    liveness = PoolLiveness("redis://unused:1/0", "c")
    liveness._client = _board()
    assert (await liveness.live("prefill"), await liveness.live("decode")) == (1, 0)


async def test_a_worker_that_stops_takes_its_key_off_the_board_at_once():
    """Real redis-server: a publisher's key is on the board while it runs and gone as soon as
    it is cancelled (a replica's graceful stop), not _TTL_S later."""
    import asyncio

    import pytest
    import redis.asyncio as aioredis

    from pdcluster.prefix_store.redis_server import RedisServer
    from pdcluster.services.pools.status_board import _TTL_S, publish_forever

    try:
        server = RedisServer().start()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    client = aioredis.from_url(server.url)
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
        server.stop()
