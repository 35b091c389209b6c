"""Where a failover shows: one log line, the ``decode.failover`` span in the
request's trace, ``pdcluster_failovers_total{reason}`` (Ray's metrics and
the gateway's /metrics), and a per-cluster tally in Redis that `pdcluster
status` prints.

The span runs from the moment the stream lost its replica to the first
token from the new one (the pause the client saw), and names both replicas
(through the prefill pool, the new one is the prefill replica that sent that
token; the decode replica's own spans follow in the same trace) and the path
(``failover.path``: ``recompute`` on the new replica, or ``prefill_pool``);
a failover whose new attempt failed too ends with that error.  Recording
never raises into a request, and never waits on Redis: the tally is
bumped in the background."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

from pdcluster.observability import metrics, tracing
log = logging.getLogger("pdcluster.gateway")
DEAD_REPLICA = "failover.dead_replica"
NEW_REPLICA = "failover.new_replica"
REASON = "failover.reason"
PATH = "failover.path"


def tally_key(cluster: str) -> str:
    """The Redis hash of failovers by reason (``gave_up:<reason>`` for the
    streams that could not, ``path:<path>`` for the resumed ones by path)."""
    return f"pdc:failovers:{cluster}"


@dataclass
class PendingSpan:
    """A failover whose new replica has not sent a token yet."""
    started_ns: int
    reason: str
    dead_replica: str
    number: int           # 1 for a stream's first failover
    tokens_sent: int
    pool: str
    path: str             # "recompute" or "prefill_pool" (failover.ResumeTarget.path)


class FailoverLog:
    """This gateway's failovers: counts for /metrics, the tally in Redis, spans."""

    def __init__(self, redis_url: str | None = None, cluster: str = "local"):
        self.redis_url, self.cluster = redis_url, cluster
        self.resumed: Counter[str] = Counter()
        self.by_path: Counter[str] = Counter()
        self.gave_up: Counter[str] = Counter()
        self._client = None
        self._background: set[asyncio.Task] = set()

    def view(self) -> dict:
        return {"resumed": dict(self.resumed), "by_path": dict(self.by_path), "gave_up": dict(self.gave_up)}

    def resumed_on(self, request_id: str, reason: str, dead_replica: str, pool: str, number: int,
                   tokens_sent: int, path: str) -> PendingSpan:
        self.resumed[reason] += 1
        self.by_path[path] += 1
        metrics.count_failover(reason)
        self._bump(reason)
        self._bump(f"path:{path}")
        log.warning("failover: request=%s reason=%s dead_replica=%s resume_pool=%s path=%s failover=%d "
                    "tokens_sent=%d", request_id, reason, dead_replica or "?", pool, path, number, tokens_sent)
        return PendingSpan(time.time_ns(), reason, dead_replica, number, tokens_sent, pool, path)

    def gave_up_on(self, request_id: str, reason: str, dead_replica: str, why: str) -> None:
        self.gave_up[reason] += 1
        self._bump(f"gave_up:{reason}")
        log.warning("failover refused: request=%s reason=%s dead_replica=%s why=%s", request_id, reason,
                    dead_replica or "?", why)

    @staticmethod
    def span(pending: PendingSpan, carrier: dict[str, str], new_replica: str,
             error: BaseException | None = None) -> None:
        try:
            tracing.record_span("decode.failover", pending.started_ns, time.time_ns(), carrier, {
                REASON: pending.reason, DEAD_REPLICA: pending.dead_replica or "unknown",
                NEW_REPLICA: new_replica or "none", tracing.POOL: pending.pool, PATH: pending.path,
                "failover.number": pending.number, tracing.OUTPUT_TOKENS: pending.tokens_sent}, error=error)
        except Exception:  # noqa: BLE001 - observability must not break the stream
            log.exception("recording the decode.failover span failed")

    def _bump(self, field: str) -> None:
        if not self.redis_url or not self.redis_url.startswith("redis"):
            return
        try:
            task = asyncio.get_running_loop().create_task(self._hincr(field))
        except RuntimeError:
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _hincr(self, field: str) -> None:
        try:
            if self._client is None:
                import redis.asyncio as aioredis
                self._client = aioredis.from_url(self.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
            await self._client.hincrby(tally_key(self.cluster), field, 1)
        except Exception as exc:  # noqa: BLE001 - the tally is best effort; the URL may hold a password
            log.debug("failover tally not recorded: %s", type(exc).__name__)


def summary(tally: dict[str, int]) -> str:
    """One line of a tally (read_tally) for `pdcluster status`::

        failovers: 5 resumed, replica_died 4, stream_broken 1 (recompute 3, prefill_pool 2); 1 gave up, ...
    """
    resumed = {k: v for k, v in tally.items() if ":" not in k}
    paths = {k.split(":", 1)[1]: v for k, v in tally.items() if k.startswith("path:")}
    gave_up = {k.split(":", 1)[1]: v for k, v in tally.items() if k.startswith("gave_up:")}
    line = f"failovers: {sum(resumed.values())} resumed" + "".join(f", {k} {v}" for k, v in resumed.items())
    if paths:
        line += " (" + ", ".join(f"{k} {v}" for k, v in paths.items()) + ")"
    if gave_up:
        line += f"; {sum(gave_up.values())} gave up" + "".join(f", {k} {v}" for k, v in gave_up.items())
    return line


def read_tally(redis_url: str, cluster: str) -> dict[str, int]:
    """The cluster's failovers by reason (and ``gave_up:<reason>``, ``path:<path>``), for `pdcluster status`."""
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    try:
        raw = client.hgetall(tally_key(cluster))
    finally:
        client.close()
    return {k.decode(): int(v) for k, v in sorted(raw.items())}
