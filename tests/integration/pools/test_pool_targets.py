"""Pool targets through a real Redis: what `pdcluster scale` and the
autoscaler publish is what the gateway's liveness reads."""

from __future__ import annotations

import asyncio
import threading

from pdcluster.services.gateway.liveness import PoolLiveness
from pdcluster.services.pools import pool_targets
from pdcluster.services.pools.status_board import publish_forever


async def test_the_gateway_reads_a_prefill_pool_at_zero_from_what_was_published(redis_server):
    cluster = "pool-targets-read"
    liveness = PoolLiveness(redis_server.url, cluster)
    assert not await liveness.scaled_to_zero("prefill")  # nothing published: not at zero
    pool_targets.publish(redis_server.url, cluster, {"prefill": 0, "decode": 2})
    liveness._read_at = 0.0  # past its one-second cache
    assert await liveness.scaled_to_zero("prefill") and not await liveness.scaled_to_zero("decode")
    assert liveness.cached_scaled_to_zero("prefill")
    pool_targets.publish(redis_server.url, cluster, {"prefill": 1})
    liveness._read_at = 0.0
    assert not await liveness.scaled_to_zero("prefill")
    other = PoolLiveness(redis_server.url, "another-cluster")
    assert not await other.scaled_to_zero("prefill")  # targets are per cluster


def test_wait_for_live_returns_once_the_board_shows_the_pool(redis_server):
    cluster = "pool-targets-live"
    assert not pool_targets.wait_for_live(redis_server.url, cluster, "prefill", timeout_s=0.5)
    loop = asyncio.new_event_loop()
    status = {"role": "prefill", "name": "p0", "engine_alive": True}
    task = loop.create_task(publish_forever(redis_server.url, cluster, "p0", lambda: status))
    runner = threading.Thread(target=loop.run_until_complete, args=(task,), daemon=True)
    runner.start()
    try:
        assert pool_targets.wait_for_live(redis_server.url, cluster, "prefill", timeout_s=10.0)
    finally:
        loop.call_soon_threadsafe(task.cancel)
        runner.join(5)
        loop.close()
