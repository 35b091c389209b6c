"""The Redis prefix index (redis.asyncio: it runs on the router's event loop).

Layout and scripts live in ``redis_layout``.  Failure policy:

* ``lookup`` is bounded by ``lookup_timeout_s`` and never raises.  After a
  failure the store is marked down for ``retry_after_s``; lookups in that
  window answer "no matches" at once (counted as skipped) instead of paying
  a connect timeout per request.
* writes raise ``IndexUnavailable`` after ``write_timeout_s``.

Every message and warning names the store by its redacted URL: the URL
carries the password.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import msgpack
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from pdcluster.prefix_store.events import DEVICE, TIERS, EventBatch
from pdcluster.prefix_store.index_base import (
    HeartbeatStatus, IndexCounters, IndexUnavailable, LookupResult, PrefixIndex, PurgeReport, tier_member,
)
from pdcluster.prefix_store.redis_layout import (
    DEREGISTER_LUA, HEARTBEAT_LUA, LOOKUP_LUA, PURGE_LUA, RedisKeys, hex16, packed_hex, parse_lookup_reply,
)
from pdcluster.prefix_store.redis_url import redact_url
from pdcluster.prefix_store.worker_id import WorkerId

log = logging.getLogger(__name__)
T = TypeVar("T")
_STORE_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
_HEARTBEAT_STATUS = {0: HeartbeatStatus.REGISTERED, 1: HeartbeatStatus.RENEWED,
                     2: HeartbeatStatus.TOOK_OVER, 3: HeartbeatStatus.SUPERSEDED}
PIPELINE_CHUNK = 8192      # commands per pipelined round trip
PURGE_CHUNK = 2000         # blocks per purge script call (bounded Redis work)


async def _bounded(op: Awaitable[T], timeout_s: float) -> T:
    """``op`` with a deadline; asyncio.timeout (3.11+) avoids wait_for's extra task."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            return await op
    return await asyncio.wait_for(op, timeout_s)


class RedisPrefixIndex(PrefixIndex):
    """``url`` may carry a password (``redis://:PASSWORD@host:port/db``); it
    is only ever shown through ``redact_url``."""

    def __init__(
        self, url: str, *, cluster: str, model: str, lookup_timeout_s: float = 0.05,
        write_timeout_s: float = 1.0, retry_after_s: float = 1.0, max_connections: int = 64,
    ) -> None:
        self.url = url
        self.keys = RedisKeys(cluster, model)
        self.lookup_timeout_s = lookup_timeout_s
        self.write_timeout_s = write_timeout_s
        self.retry_after_s = retry_after_s
        self.max_connections = max_connections
        self.counters = IndexCounters()
        self._down_until = 0.0
        self._client: aioredis.Redis | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    @property
    def shared_scope(self) -> str | None:
        return f"{self.url}|{self.keys.namespace}"

    # -- connection ---------------------------------------------------------
    def _redis(self) -> aioredis.Redis:
        """A client bound to the running loop (redis.asyncio sockets are per loop)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = aioredis.Redis.from_url(
                self.url, socket_timeout=self.write_timeout_s,
                socket_connect_timeout=self.write_timeout_s, retry=Retry(NoBackoff(), 1),
                max_connections=self.max_connections, health_check_interval=0,
            )
            self._client_loop = loop
            self._lookup = self._client.register_script(LOOKUP_LUA)
            self._heartbeat = self._client.register_script(HEARTBEAT_LUA)
            self._purge = self._client.register_script(PURGE_LUA)
            self._deregister = self._client.register_script(DEREGISTER_LUA)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            try:
                await self._client.aclose()
            except _STORE_ERRORS + (RuntimeError,):
                pass
            self._client = None

    def _note_failure(self, what: str, err: BaseException) -> str:
        self._down_until = time.monotonic() + self.retry_after_s
        msg = f"{what}: redis at {redact_url(self.url)} failed ({type(err).__name__}: {err or 'timeout'})"
        if msg != self.counters.last_error:
            log.warning("prefix index %s; routing falls back to load only, retry in %.1fs",
                        msg, self.retry_after_s)
        self.counters.last_error = msg
        return msg

    async def _write(self, what: str, op: Awaitable[T]) -> T:
        try:
            result = await _bounded(op, self.write_timeout_s)
        except _STORE_ERRORS as err:
            raise IndexUnavailable(self._note_failure(what, err) +
                                   "; buffer the events and re-sync when it is back") from err
        self._down_until = 0.0
        return result

    # -- liveness -----------------------------------------------------------
    async def register(self, worker: WorkerId, ttl_s: float, info: dict | None = None) -> HeartbeatStatus:
        blob = msgpack.packb({"name": worker.name, "epoch": worker.epoch, "ttl_s": ttl_s,
                              "registered_at_s": time.time(), **(info or {})})
        return await self._beat(worker, ttl_s, blob)

    async def heartbeat(self, worker: WorkerId, ttl_s: float) -> HeartbeatStatus:
        return await self._beat(worker, ttl_s, b"")

    async def _beat(self, worker: WorkerId, ttl_s: float, blob: bytes) -> HeartbeatStatus:
        if ttl_s <= 0:
            raise ValueError(f"heartbeat ttl_s must be > 0, got {ttl_s}")
        self._redis()
        k = self.keys
        code = await self._write("heartbeat", self._heartbeat(
            keys=[k.heartbeat(worker), k.workers, k.info(worker)],
            args=[worker.epoch, max(1, int(ttl_s * 1000)), worker.key, blob]))
        return _HEARTBEAT_STATUS[int(code)]

    async def deregister(self, worker: WorkerId) -> None:
        self._redis()
        await self._write("deregister", self._deregister(
            keys=[self.keys.heartbeat(worker)], args=[worker.epoch]))
        await self.clear_worker(worker)

    # -- events -------------------------------------------------------------
    async def publish(self, worker: WorkerId, batch: EventBatch) -> None:
        if not len(batch):
            return
        self.counters.publishes += 1
        try:
            await self._write("publish", self._publish(worker, batch))
        except IndexUnavailable:
            self.counters.publish_failures += 1
            raise

    async def _publish(self, worker: WorkerId, batch: EventBatch) -> None:
        r, k, wkey = self._redis(), self.keys, worker.key
        commands: list[tuple[str, str, list]] = []
        for tier in TIERS:
            member, suffix = tier_member(wkey, tier), "" if tier == DEVICE else f"#{tier}"
            stored, evicted = batch.stored_in(tier), batch.evicted_from(tier)
            commands += [("sadd", k.block(h), [member]) for h in stored]
            commands += [("srem", k.block(h), [member]) for h in evicted]
            for op, hashes in (("sadd", stored), ("srem", evicted)):
                for i in range(0, len(hashes), PIPELINE_CHUNK):
                    commands.append((op, k.worker_blocks(worker),
                                     [hex16(h) + suffix for h in hashes[i:i + PIPELINE_CHUNK]]))
        commands.append(("sadd", k.workers, [wkey]))
        for i in range(0, len(commands), PIPELINE_CHUNK):
            pipe = r.pipeline(transaction=False)
            for op, key, members in commands[i:i + PIPELINE_CHUNK]:
                getattr(pipe, op)(key, *members)
            await pipe.execute()

    # -- lookup -------------------------------------------------------------
    async def lookup(self, block_hashes: Sequence[int]) -> LookupResult:
        n = len(block_hashes)
        self.counters.lookups += 1
        if n == 0:
            return LookupResult({}, 0)
        if time.monotonic() < self._down_until:
            self.counters.lookups_skipped += 1
            return LookupResult.unavailable(n, self.counters.last_error)
        try:
            self._redis()
            reply = await _bounded(
                self._lookup(keys=[self.keys.block(int(block_hashes[0]))],
                             args=[self.keys.block_prefix, self.keys.heartbeat_prefix,
                                   packed_hex(block_hashes)]),
                self.lookup_timeout_s)
        except _STORE_ERRORS as err:
            self.counters.lookup_failures += 1
            return LookupResult.unavailable(n, self._note_failure("lookup", err))
        matched, tiers = parse_lookup_reply(reply)
        return LookupResult(matched, n, tier_blocks=tiers)

    # -- cleanup ------------------------------------------------------------
    async def clear_worker(self, worker: WorkerId) -> int:
        return await self._purge_worker(worker, refuse_if_live=False)

    async def _purge_worker(self, worker: WorkerId, *, refuse_if_live: bool) -> int:
        k, removed = self.keys, 0
        self._redis()
        while True:
            got, left = await self._write("purge", self._purge(
                keys=[k.worker_blocks(worker), k.workers, k.info(worker), k.heartbeat(worker)],
                args=[worker.key, k.block_prefix, PURGE_CHUNK, worker.epoch,
                      "1" if refuse_if_live else "0"]))
            removed += int(got)
            if int(left) <= 0:
                self.counters.purged_blocks += removed
                return removed

    async def _registered_workers(self) -> list[tuple[WorkerId, bool]]:
        """(worker, live at its epoch) for every key in the workers set."""
        r = self._redis()
        members = await self._write("workers", r.smembers(self.keys.workers))
        workers = sorted(WorkerId.parse(m) for m in members)
        if not workers:
            return []
        epochs = await self._write("workers", r.mget([self.keys.heartbeat(w) for w in workers]))
        return [(w, e is not None and int(e) == w.epoch) for w, e in zip(workers, epochs)]

    async def live_workers(self) -> list[WorkerId]:
        return [w for w, live in await self._registered_workers() if live]

    async def purge_dead_workers(self) -> PurgeReport:
        report = PurgeReport()
        for worker, live in await self._registered_workers():
            if not live:
                report.blocks_removed += await self._purge_worker(worker, refuse_if_live=True)
                report.workers_purged.append(worker.key)
        return report

    async def worker_info(self, worker: WorkerId) -> dict | None:
        blob = await self._write("info", self._redis().get(self.keys.info(worker)))
        return None if blob is None else msgpack.unpackb(blob)


def from_url(url: str, *, cluster: str, model: str, **options) -> RedisPrefixIndex:
    return RedisPrefixIndex(url, cluster=cluster, model=model, **options)
