"""The gateway hashes every prompt's blocks for the router and the replicas
trust those hashes, so both must start each chain from the same seed
(pdcluster/services/model_meta.py).  A replica started from other weights, another KV
dtype or another block size reports another seed in its status; while one
does, the gateway is not healthy and says which replica and both seeds.

Statuses come from the Redis status board (every replica, at most a second
old); with no board, from one replica of each pool, asked directly."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pdcluster.services.model_meta import seed_mismatches
from pdcluster.services.openai.replica_board import StatusBoardReader

log = logging.getLogger("pdcluster.gateway")
_ASK_TIMEOUT_S = 2.0


class SeedCheck:
    def __init__(self, own_seed: int, board: StatusBoardReader, handles: dict[str, Any]):
        self.own_seed, self.board, self.handles = own_seed, board, handles
        self._logged: set[str] = set()

    async def problems(self) -> list[str]:
        """One line per replica whose seed differs from the gateway's; each logged once as an error."""
        statuses = await self.board.read()
        if statuses is None:
            statuses = [s for s in [await self._ask(pool) for pool in self.handles] if s is not None]
        problems = seed_mismatches(self.own_seed, statuses)
        for line in problems:
            if line not in self._logged:
                self._logged.add(line)
                log.error("block-hash seed mismatch: %s", line)
        return problems

    async def _ask(self, pool: str) -> dict | None:
        response = self.handles[pool].status.remote()
        try:
            async with asyncio.timeout(_ASK_TIMEOUT_S):
                return await response
        except Exception:  # noqa: BLE001 - no answer yet: nothing to compare
            response.cancel()
            return None
