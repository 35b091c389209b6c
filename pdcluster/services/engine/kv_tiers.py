"""Tiers under the device pool: a full block the pool evicts is kept in host
memory (kv_host_tier.py), then on disk (kv_disk_tier.py), and a later
prompt with that prefix loads it back instead of recomputing it::

    device pool --evict (copy)--> host tier --spill (write, worker)--> disk tier
         ^                            |                                   |
         +------ load (worker: copy, or read + verify + copy) ------------+

    a waiting request's prompt blocks   [ device hit | tier hit ...... | compute ... ]
                                          acquired     fresh pool blocks, filled off the engine thread

The scheduler parks a request whose next blocks a tier holds (``lookup``,
then ``start_load``): the load holds a reference on its device hit and on
the fresh blocks it fills, on a worker thread, while steps go on.  Blocks
all in host memory are copied at once instead (on a CPU a host block comes
back by one memory copy, microseconds, where parking costs the request a
step): the request is admitted in the same step.  ``poll``
(engine thread, each step) lands finished loads: each block verified --
its hash recomputed from the parent hash and the token ids it covers, the
ids equal to the request's, a disk record's seed and crc32 -- is committed
to the prefix cache; the first that fails stops the prefix there (counted;
the rest is recomputed).  The load's references on its hit and verified
blocks pass to the request, which returns to the head of the waiting
queue holding them (nothing evicts them before admission finds them on
the device; the scheduler takes them back if a running request needs the
room).  Writes run on their own worker; a write that fails (a full
or failing disk) drops the block, counted: it will be recomputed.

Only the engine thread calls this class.  The block-hash seed (model,
dtype, KV dtype, K smoothing) keys every entry and every record, so a tier
never serves another model's or another KV dtype's block.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

import numpy as np
import torch

from pdcluster.prefix_store.hashing import hash_prompt_blocks
from pdcluster.services.engine.config import KVTierConfig
from pdcluster.services.engine.kv_cache import KVCache
from pdcluster.services.engine.kv_disk_tier import CorruptBlockError, DiskTier, read_record, record_bytes, write_record
from pdcluster.services.engine.kv_host_tier import HostTier
from pdcluster.services.engine.kv_tier_stats import TierStats

log = logging.getLogger(__name__)
TierEventCallback = Callable[[str, str, list[int]], None]  # ("stored" | "evicted", "host" | "disk", hashes)
HOST, DISK = "host", "disk"
# Host slots beyond the tier's capacity for blocks on their way to disk: a
# burst of evictions (one admission's allocation) spills up to this many
# before a write has to land; past it the oldest host block is dropped.
WRITE_BACK_BLOCKS = 256


@dataclass(frozen=True)
class TierSource:
    tier: str                 # HOST or DISK
    slot: int | None = None   # HOST: the arena row (pinned for the load)


@dataclass(frozen=True)
class LoadResult:
    num_verified: int         # leading blocks filled and verified
    failure: str | None = None


@dataclass(frozen=True)
class LandedLoad:
    """A finished load: ``keep`` (device hit + the verified blocks, now cached,
    one reference each) passes to the request; ``drop`` (blocks past the first
    that failed) goes back to the pool."""
    request_id: str
    keep: list[int]
    drop: list[int]


@dataclass
class TierLoad:
    request_id: str
    held: list[int]           # every block the load references: device hit + fresh
    fresh: list[int]          # the pool blocks being filled, prompt order
    hashes: list[int]         # of the fresh blocks
    token_ids: list[int]      # the tokens the fresh blocks cover
    sources: list[TierSource]
    future: Future


def default_sizes(config: KVTierConfig, pool_bytes: int) -> tuple[int, int]:
    """(host bytes, disk bytes) when the config leaves them unset: the host
    tier takes min(8 x the device pool, 1/4 of available memory), the disk
    tier 1/5 of the free space where its directory lives."""
    host = config.host_bytes
    if host is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        host = min(8 * pool_bytes, avail // 4)
    disk = 0
    if config.disk_dir is not None:
        disk = config.disk_bytes
        if disk is None:
            os.makedirs(config.disk_dir, exist_ok=True)
            disk = shutil.disk_usage(config.disk_dir).free // 5
    return host, disk


class KVTiers:
    def __init__(self, config: KVTierConfig, kv: KVCache, hash_seed: int,
                 on_event: TierEventCallback | None = None):
        self.kv, self.seed, self.on_event = kv, hash_seed, on_event
        spec = kv.spec
        self.block_size, self.block_bytes = spec.block_size, spec.block_bytes
        host_bytes, disk_bytes = default_sizes(config, spec.num_blocks * spec.block_bytes)
        rec = record_bytes(self.block_bytes, self.block_size)
        self.disk = DiskTier(config.disk_dir, max(1, disk_bytes // rec)) if config.disk_dir else None
        self.host = HostTier(max(1, host_bytes // self.block_bytes), self.block_bytes,
                             WRITE_BACK_BLOCKS if self.disk is not None else 0)
        # A numpy view of the pool, block-major bytes: workers copy rows in without torch's thread team.
        self._pool = kv.kv_pool.view(spec.num_blocks, -1).view(torch.uint8).numpy()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-write")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-load")
        self._writing: dict[int, tuple[int, tuple[int, ...], Future]] = {}  # hash -> (slot, tokens, write)
        self._loads: dict[int, TierLoad] = {}
        self._landed: list[LandedLoad] = []  # landed by drain(), handed out by the next poll()
        self._next_load = 0
        self.stats = TierStats(host_capacity_blocks=self.host.capacity, block_bytes=self.block_bytes,
                               disk_capacity_blocks=self.disk.max_blocks if self.disk else 0)

    # ---- device -> host -> disk ------------------------------------------
    def on_evict(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """KVCache.allocate is about to reuse ``block_id``: its bytes go to the host tier first."""
        if self.host.get(block_hash) is not None:
            self.host.touch(block_hash)
            return
        while self.host.is_full:
            self._spill(*self.host.oldest())
        if self.host.put(block_hash, tokens, self._pool[block_id]) is None:
            self._land_writes()  # a write may have landed since the last step
            if self.host.put(block_hash, tokens, self._pool[block_id]) is None:
                self.stats.host_full_drops += 1
                return
        self.stats.offloaded_blocks += 1
        self._emit("stored", HOST, [block_hash])

    def _spill(self, block_hash: int, entry) -> None:
        """The host tier's oldest block makes room: to disk, unless it has nowhere to go."""
        if self.disk is None or block_hash in self.disk or block_hash in self._writing:
            self.host.remove(block_hash)  # no disk tier, or already there or on its way
        elif len(self._writing) >= WRITE_BACK_BLOCKS:
            self.stats.spill_drops += 1
            self.host.remove(block_hash)
        else:
            self._write(block_hash, entry)
        self._emit("evicted", HOST, [block_hash])

    def _write(self, block_hash: int, entry) -> None:
        self.host.pin(entry.slot)
        self.host.remove(block_hash)
        fut = self._writer.submit(write_record, self.disk.path(block_hash), self.seed, block_hash,
                                  entry.tokens, self.host.arena[entry.slot])
        self._writing[block_hash] = (entry.slot, entry.tokens, fut)

    def _land_writes(self) -> None:
        for h in [h for h, (_, _, f) in self._writing.items() if f.done()]:
            slot, tokens, fut = self._writing.pop(h)
            self.host.unpin(slot)
            if fut.exception() is not None:
                self.stats.disk_write_failures += 1
                log.warning("KV disk tier write failed; the block will be recomputed: error=%r", fut.exception())
                continue
            self.stats.spilled_blocks += 1
            self._emit("stored", DISK, [h])
            pushed = self.disk.add(h, tokens)
            for old in pushed:
                self._writer.submit(self.disk.path(old).unlink, missing_ok=True)
            if pushed:
                self._emit("evicted", DISK, pushed)

    # ---- tiers -> device ---------------------------------------------------
    def lookup(self, block_hashes: Sequence[int], token_ids: Sequence[int], start: int) -> list[TierSource]:
        """Where blocks ``start``, ``start + 1``, ... of a prompt sit in the
        tiers, up to the first one no tier holds with these very tokens."""
        out: list[TierSource] = []
        bs = self.block_size
        for i in range(start, len(block_hashes)):
            h, tokens = block_hashes[i], tuple(token_ids[i * bs:(i + 1) * bs])
            entry = self.host.get(h)
            if entry is not None and entry.tokens == tokens:
                out.append(TierSource(HOST, entry.slot))
            elif h in self._writing and self._writing[h][1] == tokens:
                out.append(TierSource(HOST, self._writing[h][0]))
            elif self.disk is not None and self.disk.tokens(h) == tokens:
                out.append(TierSource(DISK))
            else:
                break
        return out

    def start_load(self, request_id: str, held: list[int], fresh: list[int], block_hashes: Sequence[int],
                   token_ids: Sequence[int], start: int, sources: list[TierSource]) -> LandedLoad | None:
        """Fills ``fresh`` (blocks ``start``... of the prompt) from ``sources``;
        the load owns one reference on each of ``held`` until it lands.  Blocks
        all in host memory are copied here and now (a memory copy per block,
        as eviction made; waiting a step for them would cost more than the
        copy): returns the landed load.  Any block on disk: the loader thread
        reads them all while steps go on, and ``poll`` lands them: None."""
        bs, n = self.block_size, len(fresh)
        hashes = list(block_hashes[start:start + n])
        tokens = list(token_ids[start * bs:(start + n) * bs])
        parent = block_hashes[start - 1] if start else None
        for s in sources:
            if s.slot is not None:
                self.host.pin(s.slot)
        for h in hashes:  # recently used, in every tier that has it
            self.host.touch(h)
            if self.disk is not None:
                self.disk.touch(h)
        if all(src.tier == HOST for src in sources):
            fut: Future = Future()
            fut.set_result(self._fill(fresh, hashes, tokens, parent, sources))
            return self._land(TierLoad(request_id, held, fresh, hashes, tokens, sources, fut), fut.result())
        fut = self._loader.submit(self._fill, fresh, hashes, tokens, parent, sources)
        self._next_load += 1
        self._loads[self._next_load] = TierLoad(request_id, held, fresh, hashes, tokens, sources, fut)
        return None

    def _fill(self, fresh: list[int], hashes: list[int], tokens: list[int], parent: int | None,
              sources: list[TierSource]) -> LoadResult:
        """Copies each block in, verifying it first; stops at the first that fails (the loader thread's work)."""
        bs = self.block_size
        for i, (b, h, src) in enumerate(zip(fresh, hashes, sources)):
            want = tuple(tokens[i * bs:(i + 1) * bs])
            try:
                if hash_prompt_blocks(self.seed, want, bs, parent=parent)[0] != h:
                    raise CorruptBlockError(f"block {h:#x} is not the hash of the tokens it should cover")
                if src.tier == HOST:
                    np.copyto(self._pool[b], self.host.arena[src.slot])
                else:
                    rec = read_record(self.disk.path(h), self.seed, h, bs, self.block_bytes)
                    if rec.tokens != want:
                        raise CorruptBlockError(f"disk block {h:#x} covers other token ids")
                    np.copyto(self._pool[b], rec.payload)
            except (OSError, CorruptBlockError) as exc:
                return LoadResult(i, f"{src.tier} block {i}: {exc}")
            parent = h
        return LoadResult(len(fresh))

    def poll(self) -> list[LandedLoad]:
        """Lands finished writes and loads; the caller takes each landed load's blocks."""
        self._land_writes()
        landed, self._landed = self._landed, []
        for key in [k for k, ld in self._loads.items() if ld.future.done()]:
            ld = self._loads.pop(key)
            landed.append(self._land(ld, ld.future.result()))
        return landed

    def _land(self, ld: TierLoad, res: LoadResult) -> LandedLoad:
        for s in ld.sources:
            if s.slot is not None:
                self.host.unpin(s.slot)
        k = res.num_verified
        for s in ld.sources[:k]:
            if s.tier == HOST:
                self.stats.loaded_host_blocks += 1
            else:
                self.stats.loaded_disk_blocks += 1
        if res.failure is not None:
            self.stats.load_failures += 1
            log.warning("KV tier block refused; the rest of the prefix will be recomputed: request_id=%s "
                        "error=%s", ld.request_id, res.failure)
            self._forget(ld.hashes[k], ld.sources[k].tier)
        self.kv.commit(ld.fresh[:k], ld.hashes[:k], ld.token_ids)
        num_hit = len(ld.held) - len(ld.fresh)
        return LandedLoad(ld.request_id, ld.held[:num_hit + k], ld.held[num_hit + k:])

    def _forget(self, block_hash: int, tier: str) -> None:
        """Drops a block that failed verification from the tier that served it."""
        if tier == HOST:
            gone = self.host.remove(block_hash) is not None
        else:
            gone = self.disk is not None and self.disk.remove(block_hash)
            if gone:
                self._writer.submit(self.disk.path(block_hash).unlink, missing_ok=True)
        if gone:
            self._emit("evicted", tier, [block_hash])

    def count_admission(self, loaded_from_tiers: bool) -> None:
        self.stats.admissions += 1
        self.stats.admissions_from_tiers += loaded_from_tiers

    # ---- views -----------------------------------------------------------------
    @property
    def num_loads_in_flight(self) -> int:
        return len(self._loads)

    def is_loading(self, request_id: str) -> bool:
        """Whether a load started under ``request_id`` has not landed yet."""
        return any(ld.request_id == request_id for ld in self._loads.values())

    def wait(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for a load to finish (an idle engine, nothing else to step)."""
        if self._loads:
            wait([ld.future for ld in self._loads.values()], timeout=timeout_s, return_when="FIRST_COMPLETED")

    def held_block_ids(self) -> list[int]:
        """Blocks the tiers hold a reference on: loads in flight, and landed ones not yet handed out."""
        return [b for ld in self._loads.values() for b in ld.held] + \
            [b for ld in self._landed for b in ld.keep + ld.drop]

    def snapshot(self) -> TierStats:
        s = self.stats
        s.host_blocks, s.loads_in_flight = self.host.num_blocks, len(self._loads)
        s.disk_blocks = self.disk.num_blocks if self.disk else 0
        return replace(s)

    def drain(self) -> None:
        """Waits for every write and load, and lands them (tests); the next ``poll`` hands the loads out."""
        while self._loads or self._writing:
            wait([f for *_, f in self._writing.values()] + [ld.future for ld in self._loads.values()])
            self._landed = self.poll()

    def close(self) -> None:
        """Stops the workers and removes the disk tier's records (only this process could trust them)."""
        self._writer.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        if self.disk is not None:
            self.disk.clear()

    def check_integrity(self) -> None:
        self.host.check_integrity()

    def _emit(self, kind: str, tier: str, hashes: list[int]) -> None:
        if self.on_event is not None and hashes:
            self.on_event(kind, tier, hashes)
