"""The host and disk tiers' own bookkeeping (kv_host_tier.py, kv_disk_tier.py)
and the tiers under a tiny pool with no model (kv_tiers.py): LRU order,
pinned slots never reused under a reader, a record refused for every way it
can be wrong, and the blocks a parked request loads entering the prefix
cache with the bytes they were evicted with.  The real model's output over
each tier is checked in tests/integration/engine/test_engine_kv_tiers.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdcluster.prefix_store.hashing import hash_prompt_blocks
from pdcluster.services.engine.config import KVTierConfig, SchedulerConfig
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.kv_disk_tier import CorruptBlockError, DiskTier, read_record, write_record
from pdcluster.services.engine.kv_host_tier import HostTier
from pdcluster.services.engine.kv_tiers import KVTiers
from pdcluster.services.engine.lease import LeaseTable
from pdcluster.services.engine.peer_import import lend_blocks
from pdcluster.services.engine.request import FinishReason, Request
from pdcluster.services.sampling_params import SamplingParams
from pdcluster.services.engine.scheduler import Scheduler

SEED, BS = 12345, 4


def _block(value: int, nbytes: int = 32) -> np.ndarray:
    return np.full(nbytes, value, dtype=np.uint8)


def test_host_tier_is_lru_and_never_reuses_a_pinned_slot():
    host = HostTier(2, 32, write_back=1)
    a, b = host.put(1, (1,), _block(1)), host.put(2, (2,), _block(2))
    assert host.is_full and host.put(3, (3,), _block(3)) is None  # full: the caller spills first
    host.touch(1)
    assert host.oldest()[0] == 2
    host.pin(b.slot)  # a worker still reads block 2
    host.remove(2)
    c = host.put(3, (3,), _block(3))
    assert c.slot not in (a.slot, b.slot)  # the spare slot, not the pinned one
    host.remove(1)
    d = host.put(4, (4,), _block(4))
    assert d.slot == a.slot and (host.arena[b.slot] == 2).all()  # block 2's bytes intact for its reader
    host.check_integrity()
    host.unpin(b.slot)
    host.check_integrity()
    with pytest.raises(ValueError, match="unpinned more often"):
        host.unpin(b.slot)


def test_a_disk_record_round_trips_and_is_refused_for_every_kind_of_damage(tmp_path):
    tokens, payload = (5, 6, 7, 8), np.arange(64, dtype=np.uint8)
    path = tmp_path / "x.kvb"
    write_record(path, SEED, 99, tokens, payload)
    rec = read_record(path, SEED, 99, BS, 64)
    assert rec.tokens == tokens and np.array_equal(rec.payload, payload)
    with pytest.raises(CorruptBlockError, match="seed"):
        read_record(path, SEED + 1, 99, BS, 64)  # another model or KV dtype
    with pytest.raises(CorruptBlockError, match="holds block"):
        read_record(path, SEED, 98, BS, 64)
    with pytest.raises(CorruptBlockError, match="bytes"):
        read_record(path, SEED, 99, BS, 128)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="crc32"):
        read_record(path, SEED, 99, BS, 64)
    path.write_bytes(bytes(data[:-10]))  # torn
    with pytest.raises(CorruptBlockError, match="a record is"):
        read_record(path, SEED, 99, BS, 64)


def test_disk_tier_bounds_its_blocks_and_starts_empty(tmp_path):
    (tmp_path / "0000000000000001.kvb").write_bytes(b"stale")
    disk = DiskTier(tmp_path, max_blocks=2)
    assert not list(tmp_path.iterdir())  # an earlier run's records are not trusted
    assert disk.add(1, (1,)) == [] and disk.add(2, (2,)) == []
    disk.touch(1)
    assert disk.add(3, (3,)) == [2]  # the least recently used goes
    assert 1 in disk and 3 in disk and disk.num_blocks == 2


def _pool(num_blocks: int, dtype: torch.dtype = torch.bfloat16) -> KVCache:
    spec = KVCacheSpec(num_blocks, BS, num_layers=2, num_kv_heads=1, head_dim=4, dtype=dtype)
    return KVCache(spec)


def _three_blocks_in_tiers(tmp_path, disk: bool, dtype: torch.dtype = torch.bfloat16):
    """A 4-block pool whose prompt of 3 full blocks (filled with 1, 2, 3) + 1 token was evicted
    into the tiers (host only, or one host block and the rest on disk): (kv, tiers, scheduler,
    prompt, its block hashes)."""
    kv = _pool(4, dtype)
    config = KVTierConfig(enabled=True, host_bytes=(1 if disk else 8) * kv.spec.block_bytes,
                          disk_dir=str(tmp_path) if disk else None)
    tiers = KVTiers(config, kv, SEED)
    kv.on_evict = tiers.on_evict
    sched = Scheduler(SchedulerConfig(), kv, SEED, tiers=tiers)
    prompt = list(range(100, 113))
    hashes = hash_prompt_blocks(SEED, prompt, BS)
    blocks = kv.allocate(3)
    for i, b in enumerate(blocks):
        kv.kv_pool[b].fill_(i + 1)
    kv.commit(blocks, hashes, prompt)
    kv.free(blocks)
    kv.free(kv.allocate(4))  # evicts all three into the tiers
    tiers.drain()
    return kv, tiers, sched, prompt, hashes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_evicted_blocks_come_back_into_the_prefix_cache_with_their_bytes(tmp_path, disk, dtype):
    """An 8-bit pool's blocks (values and their scales) travel as the pool holds them."""
    kv, tiers, sched, prompt, _ = _three_blocks_in_tiers(tmp_path, disk, dtype)
    assert kv.num_cached_blocks == 0
    req = Request("r", prompt, SamplingParams(max_tokens=1))
    sched.add(req)
    out = sched.schedule()
    if disk:  # two of the three blocks are on disk: parked while the loader thread reads them
        assert out.is_empty and "r" in sched.loading and tiers.held_block_ids()
        tiers.drain()
        out = sched.schedule()  # landed: admitted with the three blocks cached
    else:  # all in host memory: copied in at once, admitted in the same step
        assert not sched.loading and not tiers.held_block_ids()
    assert [s.request for s in out.prefills] == [req] and req.num_cached_tokens == 12
    assert [float(kv.kv_pool[b].float().mean()) for b in req.block_ids[:3]] == [1.0, 2.0, 3.0]
    s = tiers.snapshot()
    assert (s.loaded_disk_blocks if disk else s.loaded_host_blocks) >= 1 and s.load_failures == 0
    assert s.loaded_host_blocks + s.loaded_disk_blocks == 3
    assert s.admissions == s.admissions_from_tiers == 1
    tiers.close()


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_a_holder_brings_its_tier_blocks_back_to_lend_them_to_a_peer(tmp_path, disk):
    """A peer's lease (peer_import.lend_blocks) lends what the pool holds; blocks the holder
    keeps only in a tier are loaded back first, for no request of its own, and stay cached."""
    kv, tiers, sched, prompt, hashes = _three_blocks_in_tiers(tmp_path, disk)
    leases = LeaseTable(kv.free, default_ttl_s=30.0)
    assert lend_blocks(kv, leases, "before", hashes, prompt, start=0) is None  # the pool holds none of them

    loading = sched.stage_tier_blocks("lend:peer-1", hashes, prompt)
    if disk:  # read by the loader thread, landed by the next pass
        assert loading == 3 and tiers.is_loading("lend:peer-1")
        tiers.drain()
        sched.land_tier_loads()
    assert loading == (3 if disk else 0) and not tiers.is_loading("lend:peer-1")
    assert not tiers.held_block_ids() and kv.match_prefix(hashes, prompt).num_blocks == 3  # cached, no owner
    lent, _ = lend_blocks(kv, leases, "peer-1", hashes, prompt, start=1)
    assert [float(kv.kv_pool[b].float().mean()) for b in lent] == [2.0, 3.0]
    assert leases.release("peer-1")
    assert sched.stage_tier_blocks("lend:peer-2", hashes, prompt) == 0  # all in the pool now: nothing to load
    kv.check_integrity()
    tiers.close()


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_a_reservation_takes_the_blocks_its_host_tier_keeps_and_leaves_disk_ones_to_the_pull(tmp_path, disk):
    """A hand-off's decode side (reserve_external): the leading blocks its host tier holds come
    back into the pool and count as cached, so the sender skips them; a block on disk ends the run
    (reading it would hold up the engine thread) and is reserved for the pull like the rest."""
    kv, tiers, sched, prompt, hashes = _three_blocks_in_tiers(tmp_path, disk)
    sources = tiers.lookup(hashes, prompt, 0)
    in_host = next((i for i, src in enumerate(sources) if src.tier != "host"), len(sources))
    assert in_host == (1 if disk else 3)  # the disk case: the host tier kept the first block, the next two are on disk
    req = Request("r", prompt, SamplingParams(max_tokens=1, tenant="team-a"))
    assert sched.reserve_external(req) == in_host
    assert kv.charged.get("team-a", 0) >= in_host  # the staged blocks are the reservation's tenant's
    assert req.num_cached_tokens == in_host * BS and len(req.block_ids) == 4 and "r" in sched.awaiting_kv
    assert [float(kv.kv_pool[b].float().mean()) for b in req.block_ids[:in_host]] == [1.0, 2.0, 3.0][:in_host]
    s = tiers.snapshot()
    assert s.loaded_host_blocks == in_host and s.loaded_disk_blocks == 0 and not tiers.num_loads_in_flight
    assert not tiers.held_block_ids()
    sched.finish(req, FinishReason.ABORT)  # its K/V never came: everything goes back
    assert "r" not in sched.awaiting_kv and kv.num_free_blocks == kv.num_total_blocks
    kv.check_integrity()
    tiers.close()


def test_a_holder_lends_no_tier_block_whose_tokens_differ(tmp_path):
    kv, tiers, sched, prompt, hashes = _three_blocks_in_tiers(tmp_path, disk=False)
    other = [1] + prompt[1:]  # the same hashes claimed for other tokens: nothing loads
    assert sched.stage_tier_blocks("lend:x", hashes, other) == 0 and kv.num_cached_blocks == 0
    kv.check_integrity()
    tiers.close()


def test_a_running_request_that_needs_room_takes_back_what_a_waiting_request_holds(tmp_path):
    """A landed load's blocks wait with their request (nothing evicts them before
    its admission), but never at a running request's expense: it takes them back
    (they stay cached) before it would preempt anyone."""
    kv = _pool(4)
    tiers = KVTiers(KVTierConfig(enabled=True, host_bytes=8 * kv.spec.block_bytes), kv, SEED)
    kv.on_evict = tiers.on_evict
    sched = Scheduler(SchedulerConfig(), kv, SEED, tiers=tiers)
    running = Request("run", list(range(1, 8)), SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add(running)
    sched.update(sched.schedule(), {"run": 9})  # 7 prompt tokens
    sched.update(sched.schedule(), {"run": 9})  # + 1 decoded: 8 tokens, two full blocks
    holder = Request("hold", list(range(50, 59)), SamplingParams(max_tokens=1))
    holder.block_ids = kv.allocate(2)  # as a landed tier load hands them over
    sched.waiting.append(holder)
    assert kv.num_free_blocks == 0
    out = sched.schedule()  # its next decode needs a third block
    assert [s.request for s in out.decodes] == [running] and not out.preempted
    assert holder.block_ids == [] and len(running.block_ids) == 3
    kv.check_integrity()
    tiers.close()


def test_the_hit_rate_is_the_share_of_admissions_the_tiers_served():
    from pdcluster.services.engine.kv_tier_stats import TierStats, tier_status
    view = tier_status(TierStats(admissions=8, admissions_from_tiers=2, host_blocks=3, block_bytes=10))
    assert view["hit_rate"] == 0.25 and view["host"]["bytes"] == 30
    assert tier_status(TierStats())["hit_rate"] is None and tier_status(None) is None
