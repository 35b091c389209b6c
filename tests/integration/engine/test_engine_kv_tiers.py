"""Tiers under the KV pool (kv_tiers.py) on the real model in fp32: a prompt
whose blocks the pool evicted is served from the host tier, or from the
disk tier, and its greedy output equals recompute's token for token; a
damaged disk block is refused and recomputed; a disk that refuses writes
degrades to recompute; an abort while a load runs leaks nothing."""

from __future__ import annotations

import resource
import signal

import pytest

from pdcluster.services.engine.config import EngineConfig, KVTierConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.kv_disk_tier import SUFFIX
from pdcluster.services.sampling_params import SamplingParams
from tests.integration.engine.conftest import document

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
NUM_BLOCKS = 24  # 384 tokens: one ~200-token prompt, then the next evicts it


@pytest.fixture(scope="module")
def prompts(smol_fp32) -> dict[str, list[int]]:
    tok = smol_fp32.tokenizer
    out = {name: tok.encode(document(14, k)) for name, k in (("a", 0), ("b", 2), ("c", 4), ("d", 6))}
    assert all(180 <= len(p) <= 260 for p in out.values()), {k: len(v) for k, v in out.items()}
    return out


@pytest.fixture(scope="module")
def recomputed(smol_fp32, prompts) -> list[int]:
    """Prompt a's greedy output with no cache at all."""
    engine = Engine(EngineConfig(dtype="float32", num_kv_blocks=NUM_BLOCKS, enable_prefix_caching=False),
                    loaded=smol_fp32)
    return engine.generate([prompts["a"]], GREEDY)[0].new_token_ids


def _engine(loaded, **tiers) -> Engine:
    return Engine(EngineConfig(dtype="float32", num_kv_blocks=NUM_BLOCKS,
                               kv_tiers=KVTierConfig(enabled=True, **tiers)), loaded=loaded)


def _evict_a(engine: Engine, prompts) -> list[int]:
    """Runs a, then b, c and d, whose blocks push a's out of the pool; returns a's output."""
    first = engine.generate([prompts["a"]], GREEDY)[0]
    for name in "bcd":
        engine.generate([prompts[name]], GREEDY)
    engine.tiers.drain()  # every spill written: the test reads the tiers' state, not a race
    assert engine.kv.match_prefix(engine.scheduler.update_hashes(_req(engine, prompts["a"])),
                                  prompts["a"]).num_blocks == 0, "a's blocks should have left the pool"
    return first.new_token_ids


def _req(engine, prompt):
    from pdcluster.services.engine.request import Request
    return Request("probe", list(prompt), GREEDY)


def _again(engine: Engine, prompt: list[int]):
    out = engine.generate([prompt], GREEDY)[0]
    engine.tiers.drain()
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    return out


def test_blocks_served_from_the_host_tier_give_recomputes_output(smol_fp32, prompts, recomputed):
    engine = _engine(smol_fp32, host_bytes=64 * 2**20)
    try:
        assert _evict_a(engine, prompts) == recomputed
        out = _again(engine, prompts["a"])
        s = engine.stats().kv_tiers
        assert out.new_token_ids == recomputed
        full = (len(prompts["a"]) - 1) // 16
        assert out.num_cached_tokens == full * 16 and s.loaded_host_blocks == full, s
        assert s.loaded_disk_blocks == 0 and s.load_failures == 0
    finally:
        engine.close()


def test_blocks_served_from_the_disk_tier_give_recomputes_output(smol_fp32, prompts, recomputed, tmp_path):
    engine = _engine(smol_fp32, host_bytes=4 * engine_block_bytes(smol_fp32), disk_dir=str(tmp_path))
    try:
        assert _evict_a(engine, prompts) == recomputed
        assert len(list(tmp_path.glob("*" + SUFFIX))) == engine.stats().kv_tiers.disk_blocks > 0
        out = _again(engine, prompts["a"])
        s = engine.stats().kv_tiers
        assert out.new_token_ids == recomputed
        assert s.loaded_disk_blocks > 0 and s.load_failures == 0, s
        assert out.num_cached_tokens == 16 * (s.loaded_disk_blocks + s.loaded_host_blocks)
    finally:
        engine.close()


def test_a_damaged_disk_block_is_refused_and_recomputed(smol_fp32, prompts, recomputed, tmp_path):
    engine = _engine(smol_fp32, host_bytes=4 * engine_block_bytes(smol_fp32), disk_dir=str(tmp_path))
    try:
        _evict_a(engine, prompts)
        hashes = engine.scheduler.update_hashes(_req(engine, prompts["a"]))
        first = engine.tiers.disk.path(hashes[0])
        assert first.exists()
        data = bytearray(first.read_bytes())
        data[len(data) // 2] ^= 0x40  # one bit in the payload
        first.write_bytes(bytes(data))
        out = _again(engine, prompts["a"])
        s = engine.stats().kv_tiers
        assert out.new_token_ids == recomputed
        assert s.load_failures == 1 and out.num_cached_tokens == 0, s  # block 0 refused: nothing after it counts
        assert not first.exists() and hashes[0] not in engine.tiers.disk
    finally:
        engine.close()


def test_a_disk_that_refuses_writes_degrades_to_recompute(smol_fp32, prompts, recomputed, tmp_path):
    """The process may write no file beyond a few bytes (RLIMIT_FSIZE): every
    spill fails as on a full disk (EFBIG, like ENOSPC an OSError)."""
    engine = _engine(smol_fp32, host_bytes=4 * engine_block_bytes(smol_fp32), disk_dir=str(tmp_path))
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, old_limit[1]))
    try:
        _evict_a(engine, prompts)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    try:
        s = engine.stats().kv_tiers
        assert s.disk_write_failures > 0 and s.disk_blocks == 0 and s.spilled_blocks == 0, s
        assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*" + SUFFIX))
        out = _again(engine, prompts["a"])
        assert out.new_token_ids == recomputed
        assert engine.stats().kv_tiers.loaded_disk_blocks == 0
    finally:
        engine.close()


def test_an_abort_while_blocks_load_leaks_nothing(smol_fp32, prompts, tmp_path):
    engine = _engine(smol_fp32, host_bytes=4 * engine_block_bytes(smol_fp32), disk_dir=str(tmp_path))
    try:
        _evict_a(engine, prompts)
        engine.add_request("a-again", prompts["a"], GREEDY)
        assert engine.step() == [] and "a-again" in engine.scheduler.loading  # parked while its blocks load
        assert engine.tiers.num_loads_in_flight == 1 and engine.tiers.held_block_ids()
        engine.check_integrity()  # the load owns its blocks
        assert engine.abort("a-again")
        assert not engine.has_unfinished()
        engine.tiers.drain()
        engine.check_integrity()  # landed, not yet handed back: still the tiers' own
        engine.expire_stale()  # what the idle engine loop runs
        engine.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks and not engine.tiers.held_block_ids()
    finally:
        engine.close()


def engine_block_bytes(loaded) -> int:
    c = loaded.config
    return c.num_layers * 2 * 16 * c.num_kv_heads * c.head_dim * 4  # fp32 pool


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk"])
def test_a_prefix_a_peer_keeps_only_in_its_tiers_is_lent_and_gives_recomputes_output(smol_fp32, prompts, recomputed,
                                                                                     tmp_path, disk):
    """Peer prefix fetch from a holder whose copy left its pool: the holder loads the blocks back
    (stage_for_lending), lends them under a lease, their bytes land in a second engine's pool
    (the transfer's part, here a copy; tests/integration/cluster/test_cluster_peer_fetch.py runs
    it over the transfer layer) and its greedy output equals recompute's."""
    tiers = {"host_bytes": 4 * engine_block_bytes(smol_fp32), "disk_dir": str(tmp_path)} if disk else \
        {"host_bytes": 64 * 2**20}
    holder = _engine(smol_fp32, **tiers)
    puller = Engine(EngineConfig(dtype="float32", num_kv_blocks=NUM_BLOCKS), loaded=smol_fp32)
    try:
        _evict_a(holder, prompts)
        prompt = prompts["a"]
        hashes = holder.scheduler.update_hashes(_req(holder, prompt))
        full = (len(prompt) - 1) // 16
        loading = holder.stage_for_lending("lend:peer", hashes, prompt)
        for _ in range(120):  # a hang guard: the loader reads a few blocks in milliseconds
            if not holder.tier_blocks_loading("lend:peer"):
                break
            holder.tiers.wait(1.0)
        assert not holder.tier_blocks_loading("lend:peer")
        assert (loading > 0) == disk
        lent, _ = holder.lease_prefix("peer", hashes, prompt, 0)
        assert len(lent) >= full
        fresh = puller.peer_imports.reserve("peer", full, GREEDY.tenant)
        for src, dst in zip(lent, fresh):
            puller.kv.kv_pool[dst].copy_(holder.kv.kv_pool[src])
        assert holder.release_lease("peer")
        assert puller.land_peer_import("peer", hashes, prompt, 0).num_committed == full
        out = puller.generate([prompt], GREEDY)[0]
        assert out.new_token_ids == recomputed and out.num_cached_tokens == full * 16
        s = holder.stats().kv_tiers
        assert (s.loaded_disk_blocks > 0 if disk else s.loaded_host_blocks == full) and s.load_failures == 0, s
        holder.check_integrity()
        assert not holder.tiers.held_block_ids()
    finally:
        holder.close()
        puller.close()


def test_a_hand_off_takes_the_prefix_its_host_tier_keeps_and_gives_recomputes_output(smol_fp32, prompts, recomputed):
    """A decode engine whose host tier keeps a prompt's blocks reserves them as cached (reserve_external):
    the prefill engine's hand-off sends only the rest, here the last partial block, over the transfer
    layer (tests/integration/engine/hand_off.py), and the decoded tokens equal recompute's."""
    from tests.integration.engine.hand_off import decode_all, prefill_and_pull

    decode = _engine(smol_fp32, host_bytes=64 * 2**20)
    prefill = Engine(EngineConfig(dtype="float32", num_kv_blocks=NUM_BLOCKS), loaded=smol_fp32)
    try:
        _evict_a(decode, prompts)
        prompt = prompts["a"]
        full, blocks = len(prompt) // 16, -(-len(prompt) // 16)
        first, _, pulled = prefill_and_pull(prefill, decode, [("handed", prompt, GREEDY)])
        s = decode.stats().kv_tiers
        assert pulled == blocks - full and s.loaded_host_blocks == full and s.load_failures == 0, (pulled, s)
        assert decode_all(decode, first)["handed"] == recomputed
        decode.check_integrity()
        assert not decode.tiers.held_block_ids()
    finally:
        prefill.close()
        decode.close()
