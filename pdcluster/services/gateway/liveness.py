"""How many replicas of a pool are alive, from the Redis status board
(every worker refreshes its key every 0.5 s with a 5 s TTL, saying whether
its engine loop is alive), and the pools' targets (pdcluster/services/pools/pool_targets.py).
The gateway asks before a disaggregated request, so a request never waits
for a prefill pool that has no replica: with the pool scaled to zero on
purpose the decode replica prefills it; with its replicas gone it fails
with 503, or falls back to colocated.
``redis_url`` may carry the password; it is never logged."""

from __future__ import annotations

import logging
import time

from pdcluster.services.pools import pool_targets
from pdcluster.services.pools.status_board import read_statuses

log = logging.getLogger("pdcluster.gateway")
_CACHE_S = 1.0


class PoolLiveness:
    def __init__(self, redis_url: str | None, cluster: str):
        self.redis_url, self.cluster = redis_url, cluster
        self._client = None
        self._counts: dict[str, int] = {}
        self._targets: dict[str, int] = {}
        self._prefill: dict[str, list[tuple[float, float | None]]] = {}  # role -> start-up prefill lines
        self._steps: dict[str, list[tuple[float, float]]] = {}  # role -> their start-up decode step lines
        self._read_at = 0.0

    async def live(self, role: str) -> int | None:
        """Live replicas of ``role``; None when unknown (no Redis, or Redis
        down): the caller must not refuse requests on a guess."""
        if not await self._refresh():
            return None
        return self._counts.get(role, 0)

    def prefill_line(self, role: str) -> tuple[float, float | None] | None:
        """(seconds per token, per squared token) of the prefill line ``role``'s live replicas measured
        at start-up (startup_profile.py), each the median over them, as of the last read (the square
        term None when no replica published one); None when none published a line."""
        lines = self._prefill.get(role, ())
        if not lines:
            return None
        per_token = sorted(a for a, _ in lines)
        squares = sorted(b for _, b in lines if b is not None)
        return per_token[len(per_token) // 2], (squares[len(squares) // 2] if squares else None)

    def decode_step_s(self, role: str) -> tuple[float, float] | None:
        """(base seconds, seconds per sequence) of the decode step ``role``'s live replicas measured at
        start-up, each the median over them, as of the last read; None when none published one."""
        lines = self._steps.get(role, ())
        if not lines:
            return None
        bases, slopes = sorted(b for b, _ in lines), sorted(p for _, p in lines)
        return bases[len(bases) // 2], slopes[len(slopes) // 2]

    async def scaled_to_zero(self, role: str) -> bool:
        """Whether ``role``'s pool is meant to have no replica (a target of 0)."""
        await self._refresh()
        return self.cached_scaled_to_zero(role)

    def cached_scaled_to_zero(self, role: str) -> bool:
        """The same from the last read (at most about a second old): for callers without an await."""
        return self._targets.get(role) == 0

    async def _refresh(self) -> bool:
        if not self.redis_url or not self.redis_url.startswith("redis"):
            return False
        now = time.monotonic()
        if now - self._read_at > _CACHE_S:
            try:
                self._counts, self._prefill, self._steps = await self._read()
                self._targets = await pool_targets.read(self._client, self.cluster)
            except Exception as exc:  # noqa: BLE001 - liveness is advisory
                log.debug("pool liveness unknown: %s", exc)
                return False
            self._read_at = now
        return True

    async def _read(self) -> tuple[dict[str, int], dict[str, list[tuple[float, float | None]]],
                                   dict[str, list[tuple[float, float]]]]:
        import redis.asyncio as aioredis

        if self._client is None:
            self._client = aioredis.from_url(self.redis_url, socket_timeout=0.2, socket_connect_timeout=0.2)
        counts: dict[str, int] = {}
        prefill: dict[str, list[tuple[float, float | None]]] = {}
        steps: dict[str, list[tuple[float, float]]] = {}
        for status in await read_statuses(self._client, self.cluster):
            if status.get("engine_alive", True):  # a replica whose engine died does not count
                role = status.get("role", "")
                counts[role] = counts.get(role, 0) + 1
                measured = status.get("prefill_per_token_s")
                square = status.get("prefill_per_token2_s")
                if isinstance(measured, (int, float)) and 0 < measured < 1:  # a board entry is data, not trusted
                    square = float(square) if isinstance(square, (int, float)) and 0 <= square < 1e-3 else None
                    prefill.setdefault(role, []).append((float(measured), square))
                step = status.get("decode_step_s")
                if (isinstance(step, list) and len(step) == 2 and all(isinstance(x, (int, float)) for x in step)
                        and 0 < step[0] < 1 and 0 <= step[1] < 1):
                    steps.setdefault(role, []).append((float(step[0]), float(step[1])))
        return counts, prefill, steps
