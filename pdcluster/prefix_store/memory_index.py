"""In-process prefix index with the same behaviour as the Redis one.

For single-process use (engine-only runs) and unit tests.  State:

    holders[block_hash] -> {member}            who holds each block, where (index_base.tier_member)
    blocks[worker key]  -> {(hash, member)}    for cleanup
    live[name]          -> (epoch, deadline)   liveness, by heartbeat

A worker key counts only while ``live[name]`` holds its epoch and the
deadline has not passed -- exactly the Redis heartbeat-key rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdcluster.prefix_store.events import DEVICE, LOWER_TIERS, EventBatch
from pdcluster.prefix_store.index_base import (
    HeartbeatStatus, IndexCounters, LookupResult, PrefixIndex, PurgeReport, split_member, tier_member,
)
from pdcluster.prefix_store.worker_id import WorkerId


class InMemoryPrefixIndex(PrefixIndex):
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[tuple[int, str]]] = {}
        self._live: dict[str, tuple[int, float]] = {}
        self._info: dict[str, dict] = {}
        self.counters = IndexCounters()

    def _live_epoch(self, name: str) -> int | None:
        entry = self._live.get(name)
        if entry is None or entry[1] <= self._clock():
            return None
        return entry[0]

    def _is_live(self, worker_key: str) -> bool:
        worker = WorkerId.parse(split_member(worker_key)[0])
        return self._live_epoch(worker.name) == worker.epoch

    async def register(self, worker: WorkerId, ttl_s: float, info: dict | None = None) -> HeartbeatStatus:
        status = await self.heartbeat(worker, ttl_s)
        if info is not None and status is not HeartbeatStatus.SUPERSEDED:
            self._info[worker.key] = dict(info)
        return status

    async def heartbeat(self, worker: WorkerId, ttl_s: float) -> HeartbeatStatus:
        current = self._live_epoch(worker.name)
        if current is not None and current > worker.epoch:
            return HeartbeatStatus.SUPERSEDED
        self._live[worker.name] = (worker.epoch, self._clock() + ttl_s)
        self._blocks.setdefault(worker.key, set())
        if current is None:
            return HeartbeatStatus.REGISTERED
        return HeartbeatStatus.RENEWED if current == worker.epoch else HeartbeatStatus.TOOK_OVER

    async def deregister(self, worker: WorkerId) -> None:
        if self._live_epoch(worker.name) == worker.epoch:
            del self._live[worker.name]
        await self.clear_worker(worker)

    async def publish(self, worker: WorkerId, batch: EventBatch) -> None:
        self.counters.publishes += 1
        mine = self._blocks.setdefault(worker.key, set())
        events = [(h, DEVICE, kind) for h, kind in batch.last_kind.items()]
        events += [(h, tier, kind) for (h, tier), kind in batch.tier_kind.items()]
        for h, tier, kind in events:
            member = tier_member(worker.key, tier)
            if kind == "stored":
                self._holders.setdefault(h, set()).add(member)
                mine.add((h, member))
            else:
                self._drop(h, member)
                mine.discard((h, member))

    def _drop(self, h: int, member: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(member)
            if not holders:
                del self._holders[h]

    async def clear_worker(self, worker: WorkerId) -> int:
        removed = self._remove_entries(worker.key)
        self._info.pop(worker.key, None)
        return removed

    def _remove_entries(self, worker_key: str) -> int:
        mine = self._blocks.pop(worker_key, set())
        for h, member in mine:
            self._drop(h, member)
        self.counters.purged_blocks += len(mine)
        return len(mine)

    async def lookup(self, block_hashes: Sequence[int]) -> LookupResult:
        self.counters.lookups += 1
        n = len(block_hashes)
        if n == 0:
            return LookupResult({}, 0)
        first = self._holders.get(int(block_hashes[0]), ())
        active = {split_member(m)[0] for m in first if self._is_live(m)}
        matched: dict[str, int] = {}
        lower: dict[str, dict[str, int]] = {k: {} for k in active}
        for i in range(n):
            if not active:
                break
            holders = self._holders.get(int(block_hashes[i]), set())
            for k in list(active):
                tier = next((t for t in (DEVICE, *LOWER_TIERS) if tier_member(k, t) in holders), None)
                if tier is None:
                    matched[k] = i
                    active.discard(k)
                elif tier != DEVICE:
                    lower[k][tier] = lower[k].get(tier, 0) + 1
        for k in active:
            matched[k] = n
        name = lambda k: WorkerId.parse(k).name  # noqa: E731
        return LookupResult({name(k): m for k, m in matched.items()}, n,
                            tier_blocks={name(k): t for k, t in lower.items() if t})

    async def live_workers(self) -> list[WorkerId]:
        now = self._clock()
        return sorted(WorkerId(name, epoch) for name, (epoch, deadline) in self._live.items() if deadline > now)

    async def purge_dead_workers(self) -> PurgeReport:
        report = PurgeReport()
        for key in [k for k in self._blocks if not self._is_live(k)]:
            report.blocks_removed += self._remove_entries(key)
            self._info.pop(key, None)
            report.workers_purged.append(key)
        return report

    def worker_info(self, worker: WorkerId) -> dict | None:
        return self._info.get(worker.key)


def from_url(url: str | None, *, cluster: str, model: str, clock: Callable[[], float] = time.monotonic,
             **_store_options) -> InMemoryPrefixIndex:
    """One private index per call (there is nothing to share across processes);
    store options such as timeouts do not apply and are ignored."""
    return InMemoryPrefixIndex(clock=clock)
