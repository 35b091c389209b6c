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
