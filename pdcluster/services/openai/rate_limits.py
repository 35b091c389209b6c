"""Per-tenant rate limits: token buckets on requests per second and on
tokens per second (a request costs its prompt tokens plus the tokens it may
generate, ``max_tokens`` x ``n``).  Pure: the clock is passed in.

A bucket holds ``rate x burst_s`` (at least one request's worth) and refills
at ``rate``.  A request is let in when the bucket holds what it costs, or is
full (so a request larger than the whole bucket still passes, alone, and
leaves the bucket in debt); otherwise the answer is the seconds until it
would pass: the 429's Retry-After.  A tenant without a limit is never
refused here (admission's SLO rule still applies to everyone)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


_MAX_RETRY_AFTER_S = 86_400.0


@dataclass
class TokenBucket:
    rate: float        # units per second
    capacity: float    # units it holds when full
    level: float
    updated: float     # the clock's reading at ``level``

    @classmethod
    def full(cls, rate: float, burst_s: float, smallest: float, now: float) -> TokenBucket:
        capacity = max(rate * burst_s, smallest)
        return cls(rate, capacity, capacity, now)

    def take(self, cost: float, now: float) -> float:
        """0 when ``cost`` was taken; else the seconds until it could be (nothing taken)."""
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now
        need = min(cost, self.capacity)
        if self.level >= need:
            self.level -= cost
            return 0.0
        return (need - self.level) / self.rate


@dataclass(frozen=True)
class TenantLimit:
    tenant: str
    requests_per_s: float | None = None
    tokens_per_s: float | None = None
    burst_s: float = 1.0


@dataclass(frozen=True)
class RateRefusal:
    tenant: str
    retry_after_s: float
    message: str

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, at least 1; at most a day (a tiny configured rate gives a huge or infinite wait)."""
        return str(max(1, math.ceil(min(self.retry_after_s, _MAX_RETRY_AFTER_S))))


class TenantRateLimits:
    def __init__(self, limits: Iterable[TenantLimit], clock: Callable[[], float] = time.monotonic) -> None:
        self._limits = {lim.tenant: lim for lim in limits}
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._requests = {t: TokenBucket.full(lim.requests_per_s, lim.burst_s, 1.0, now)
                          for t, lim in self._limits.items() if lim.requests_per_s}
        self._tokens = {t: TokenBucket.full(lim.tokens_per_s, lim.burst_s, 1.0, now)
                        for t, lim in self._limits.items() if lim.tokens_per_s}

    def __bool__(self) -> bool:
        return bool(self._requests or self._tokens)

    def admit_request(self, tenant: str) -> RateRefusal | None:
        """Checked as a request arrives, before any work is done for it."""
        bucket = self._requests.get(tenant)
        if bucket is None:
            return None
        with self._lock:
            wait_s = bucket.take(1.0, self._clock())
        if not wait_s:
            return None
        lim = self._limits[tenant]
        return RateRefusal(tenant, wait_s, f"tenant {tenant!r} is over its limit of {lim.requests_per_s:g} "
                                           f"requests/s; retry after {wait_s:.1f} s")

    def admit_tokens(self, tenant: str, tokens: int) -> RateRefusal | None:
        """Checked once the prompt is tokenized: ``tokens`` = prompt + max_tokens x n."""
        bucket = self._tokens.get(tenant)
        if bucket is None:
            return None
        with self._lock:
            wait_s = bucket.take(float(tokens), self._clock())
        if not wait_s:
            return None
        lim = self._limits[tenant]
        return RateRefusal(tenant, wait_s, f"tenant {tenant!r} is over its limit of {lim.tokens_per_s:g} tokens/s "
                                           f"(this request counts {tokens}: prompt + max_tokens x n); retry after "
                                           f"{wait_s:.1f} s")
