"""The replica count each pool is meant to have, in Redis beside the status
board.  Whoever deploys writes it (LocalCluster.start and .apply: `pdcluster
up`, `pdcluster scale`, the autoscaler), so the gateway can tell a prefill
pool scaled to zero on purpose -- its prompts are then prefilled on the
decode replicas -- from one whose replicas died (503, or
fallback_to_colocated).  The board alone cannot: a stopped replica's key
outlives it by its TTL, and a call to a pool of zero replicas would wait.

Order around a deploy (``publish_first``), so no request is sent to a
prefill pool that is not there:

    to zero     publish, wait DRAIN_S (the gateway's cached view turns over,
                hand-offs in flight are pulled), then deploy
    from zero   deploy, wait for a live prefill replica on the board, then publish
    otherwise   deploy, then publish

``redis_url`` may carry the password; it is never logged."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("pdcluster.pools")
POOLS = ("prefill", "decode", "colocated")
DRAIN_S = 2.5  # > the gateway's 1 s liveness cache, + time for a hand-off in flight to be pulled


def _key(cluster: str) -> str:
    return f"pdc:pool_targets:{cluster}"


def targets_of(config) -> dict[str, int]:
    """``config``: a ClusterConfig; the pools its mode deploys."""
    pools = ("prefill", "decode") if config.mode == "disaggregated" else ("colocated",)
    return {pool: getattr(config, pool).num_replicas for pool in pools}


def publish_first(old: dict[str, int], new: dict[str, int]) -> bool:
    """Whether the gateway must learn ``new`` before the deploy: a pool going to zero."""
    return any(new.get(pool, 1) == 0 < old.get(pool, 1) for pool in POOLS)


def publish(redis_url: str, cluster: str, targets: dict[str, int]) -> None:
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    try:
        client.hset(_key(cluster), mapping={pool: int(n) for pool, n in targets.items()})
    finally:
        client.close()


async def read(client, cluster: str) -> dict[str, int]:
    """Through an open ``redis.asyncio`` client; {} when nothing was published."""
    raw = await client.hgetall(_key(cluster))
    out = {}
    for pool, n in raw.items():
        try:
            out[pool.decode() if isinstance(pool, bytes) else str(pool)] = int(n)
        except (TypeError, ValueError):
            continue  # written by something else: ignored, as the board ignores a bad status
    return out


def wait_for_live(redis_url: str, cluster: str, pool: str, timeout_s: float = 60.0) -> bool:
    """Until the status board shows a replica of ``pool`` with a live engine loop."""
    from pdcluster.services.pools.status_board import read_board

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s.get("role") == pool and s.get("engine_alive", True) for s in read_board(redis_url, cluster)):
            return True
        time.sleep(0.25)
    log.warning("no live %s replica on the status board after %.0f s; publishing its target anyway", pool, timeout_s)
    return False
