"""The engine-side bookkeeping of a peer prefix fetch (peer_import.py) on a
tiny pool with no model: the holder's blocks pinned under a lease and given
back with it; the puller's fresh blocks held while the pull writes them,
committed to the prefix cache only once their hash chain verifies, and back
in the pool (uncached) whatever fails.  Exact block ids, ref counts and
integrity after every scenario."""

from __future__ import annotations

import pytest
import torch

from pdcluster.prefix_store.hashing import hash_prompt_blocks
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.lease import LeaseTable
from pdcluster.services.engine.peer_import import PeerImports, lend_blocks

SEED, BS = 777, 4


def _kv(num_blocks: int = 8) -> KVCache:
    return KVCache(KVCacheSpec(num_blocks, BS, 2, 1, 4, torch.float32))


def _cached_prompt(kv: KVCache, tokens: list[int]) -> list[int]:
    """Computes (pretends to) and caches every full block of ``tokens``; returns their ids."""
    hashes = hash_prompt_blocks(SEED, tokens, BS)
    blocks = kv.allocate(len(hashes))
    kv.commit(blocks, hashes, tokens)
    kv.free(blocks)
    return blocks


TOKENS = list(range(100, 118))  # 4 full blocks + 2 tokens
HASHES = hash_prompt_blocks(SEED, TOKENS, BS)


def test_the_holder_lends_its_cached_blocks_under_a_lease_and_gets_them_back_with_it():
    kv = _kv()
    blocks = _cached_prompt(kv, TOKENS)
    leases = LeaseTable(kv.free, default_ttl_s=30.0)
    lent, deadline = lend_blocks(kv, leases, "peer-1", HASHES, TOKENS, start=1)
    assert lent == tuple(blocks[1:]) and deadline > 0
    assert [kv.ref_count(b) for b in blocks] == [0, 1, 1, 1]  # pinned: never evicted under the read
    assert kv.num_free_blocks == 8 - 3
    assert leases.begin_read("peer-1", lent) is None
    leases.end_read("peer-1")
    assert leases.release("peer-1")
    assert [kv.ref_count(b) for b in blocks] == [0, 0, 0, 0] and kv.num_cached_blocks == 4  # still cached
    kv.check_integrity()


def test_the_holder_lends_nothing_it_does_not_hold_with_these_tokens():
    kv = _kv()
    _cached_prompt(kv, TOKENS)
    leases = LeaseTable(kv.free)
    other = [1] + TOKENS[1:]  # same hashes claimed, other tokens: a hash is not trusted alone
    assert lend_blocks(kv, leases, "peer-1", HASHES, other, start=0) is None
    assert lend_blocks(kv, leases, "peer-2", HASHES, TOKENS, start=4) is None  # nothing past the asker's
    assert len(leases) == 0
    kv.check_integrity()


def test_pulled_blocks_enter_the_prefix_cache_only_once_verified():
    kv = _kv()
    imports = PeerImports(kv, SEED)
    fresh = imports.reserve("r1", 3, "default")
    assert fresh == [0, 1, 2] and imports.held_block_ids() == fresh
    assert kv.match_prefix(HASHES, TOKENS).num_blocks == 0  # held, not yet visible
    landed = imports.land("r1", HASHES, TOKENS, start=0)
    assert (landed.num_committed, landed.num_blocks, landed.failure) == (3, 3, None)
    match = kv.match_prefix(HASHES, TOKENS)
    assert match.block_ids == (0, 1, 2) and match.num_evictable == 3  # cached, unreferenced: admission takes them
    assert imports.held_block_ids() == [] and "r1" not in imports
    kv.check_integrity()


def test_a_block_whose_hash_does_not_verify_stops_the_prefix_there():
    kv = _kv()
    imports = PeerImports(kv, SEED)
    imports.reserve("r1", 3, "default")
    wrong = list(HASHES)
    wrong[2] ^= 1  # the third block's hash names other tokens
    landed = imports.land("r1", wrong, TOKENS, start=1)  # blocks 1, 2, 3 of the prompt
    assert landed.num_committed == 1 and "block 1" in landed.failure
    assert kv.num_cached_blocks == 1 and kv.num_free_blocks == 8
    assert imports.num_refused_blocks == 2
    kv.check_integrity()


def test_a_failed_pull_gives_every_block_back_uncached():
    kv = _kv()
    imports = PeerImports(kv, SEED)
    imports.reserve("r1", 2, "default")
    assert imports.drop("r1") == 2 and imports.drop("r1") == 0
    assert kv.num_free_blocks == 8 and kv.num_cached_blocks == 0
    imports.reserve("r2", 2, "default")
    taken = imports.take("r2")  # in doubt: the caller quarantines them
    assert len(taken) == 2 and imports.held_block_ids() == [] and all(kv.ref_count(b) == 1 for b in taken)
    kv.free(taken)
    kv.check_integrity()


def test_reserve_keeps_room_for_the_running_requests():
    kv = _kv(4)
    imports = PeerImports(kv, SEED)
    assert imports.reserve("r1", 3, "default", keep_free=2) is None
    assert imports.reserve("r1", 2, "default", keep_free=2) is not None
    with pytest.raises(KeyError):
        imports.reserve("r1", 1, "default")
    assert imports.reserve("r2", 0, "default") is None
    imports.drop("r1")
    kv.check_integrity()
