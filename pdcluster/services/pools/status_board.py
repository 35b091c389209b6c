"""Per-replica status in Redis, for `pdcluster status` and tests: every
worker writes its status JSON under a key with a short TTL, so a dead
replica disappears from the board by itself, and one that stops takes its key
away as it goes (the gateway's liveness and a scale-down see it gone at once,
not up to _TTL_S later).  ``redis_url`` may carry the
password (``redis://:PASSWORD@host:port/db``): it goes to redis-py as it is
and is never logged."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

log = logging.getLogger("pdcluster.status")
_TTL_S = 5
_PERIOD_S = 0.5
_GOODBYE_S = 1.0  # a stopping worker waits this long at most to take its key away


def _key(cluster: str, worker: str = "*") -> str:
    return f"pdc:status:{cluster}:{worker}"


async def publish_forever(redis_url: str, cluster: str, worker: str, status: Callable[[], dict]) -> None:
    """Background task of a worker; survives Redis outages."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        while True:
            try:
                await client.set(_key(cluster, worker), json.dumps(status()), ex=_TTL_S)
            except Exception as exc:  # noqa: BLE001 - status is best effort
                log.debug("status publish failed: %s", exc)
            await asyncio.sleep(_PERIOD_S)
    finally:
        try:
            await asyncio.wait_for(client.delete(_key(cluster, worker)), _GOODBYE_S)
        except Exception as exc:  # noqa: BLE001 - the key expires by itself
            log.debug("status key not removed: %s", exc)
        await client.aclose()


async def read_statuses(client, cluster: str) -> list[dict]:
    """Every live worker's latest status, through an open ``redis.asyncio``
    client (the gateway's readers keep one)."""
    keys = [k async for k in client.scan_iter(_key(cluster))]
    return _parse(await client.mget(keys) if keys else [])


def read_board(redis_url: str, cluster: str) -> list[dict]:
    """Every live worker's latest status, sorted by role then name (for the
    CLI and tests, which have no event loop to share)."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    try:
        keys = sorted(client.scan_iter(_key(cluster)))
        values = client.mget(keys) if keys else []
    finally:
        client.close()
    return sorted(_parse(values), key=lambda s: (s.get("role", ""), s.get("name", "")))


def _parse(values: list) -> list[dict]:
    """The statuses among raw values: a key that expired between SCAN and MGET
    is None, and a replica mid-upgrade may write something else; both are skipped."""
    out = []
    for raw in values:
        try:
            status = json.loads(raw) if raw else None
        except ValueError:
            continue
        if isinstance(status, dict):
            out.append(status)
    return out
