"""The replicas' statuses as the gateway reads them from the Redis status
board (pdcluster/services/pools/status_board.py: every replica rewrites its key every
0.5 s, with a 5 s TTL), for /metrics.

Read asynchronously, at most once per ``max_age_s`` however often Prometheus
scrapes, and bounded by ``timeout_s``: a slow or absent Redis costs a scrape
half a second at most, once a second at most, and the answer is then None
("unknown"), never an empty board.  ``redis_url`` may carry the password;
it is never logged."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pdcluster.services.pools.status_board import read_statuses

log = logging.getLogger("pdcluster.gateway")


class StatusBoardReader:
    def __init__(self, redis_url: str | None, cluster: str, max_age_s: float = 1.0, timeout_s: float = 0.5):
        self.redis_url, self.cluster = redis_url, cluster
        self.max_age_s, self.timeout_s = max_age_s, timeout_s
        self._client: Any = None
        self._statuses: list[dict] | None = None
        self._read_at = float("-inf")

    @property
    def enabled(self) -> bool:
        return bool(self.redis_url) and self.redis_url.startswith(("redis://", "rediss://", "unix://"))

    async def read(self) -> list[dict] | None:
        """Every live replica's latest status (at most ``max_age_s`` old), or
        None when the board cannot be read (no Redis configured, or Redis down)."""
        if not self.enabled:
            return None
        now = time.monotonic()
        if now - self._read_at < self.max_age_s:
            return self._statuses
        self._read_at = now   # before the read: concurrent scrapes share this one
        try:
            async with asyncio.timeout(self.timeout_s):
                self._statuses = await self._fetch()
        except Exception as exc:  # noqa: BLE001 - the board is advisory: its gauges go absent
            log.debug("status board unreadable: %s", type(exc).__name__)
            self._statuses = None
        return self._statuses

    async def _fetch(self) -> list[dict]:
        import redis.asyncio as aioredis

        if self._client is None:
            self._client = aioredis.from_url(self.redis_url, socket_timeout=self.timeout_s,
                                             socket_connect_timeout=self.timeout_s)
        return await read_statuses(self._client, self.cluster)

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
