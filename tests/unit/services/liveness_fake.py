"""pdcluster.services.gateway.liveness.PoolLiveness's interface over fixed numbers,
for the gateway's decisions without Redis (tests/integration/pools/
test_pool_targets.py reads the real one from a real Redis)."""

from __future__ import annotations


class FakeLiveness:
    """``counts``: per role, one number for every role, or None (unknown: no Redis)."""

    def __init__(self, counts: dict[str, int] | int | None, targets: dict[str, int] | None = None,
                 per_token_s: dict[str, float | tuple[float, float]] | None = None):
        self.counts, self.targets, self.per_token_s = counts, dict(targets or {}), dict(per_token_s or {})

    async def live(self, role: str) -> int | None:
        return self.counts.get(role, 0) if isinstance(self.counts, dict) else self.counts

    async def scaled_to_zero(self, role: str) -> bool:
        return self.cached_scaled_to_zero(role)

    def prefill_line(self, role: str) -> tuple[float, float | None] | None:
        """``per_token_s[role]``: seconds per token alone (no square term published), or both."""
        line = self.per_token_s.get(role)
        return None if line is None else tuple(line) if isinstance(line, tuple) else (line, None)

    def cached_scaled_to_zero(self, role: str) -> bool:
        return self.targets.get(role) == 0
