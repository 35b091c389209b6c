"""Per-tenant KV quotas (kv_quota.py): the victim rule's table, and a pool
where one tenant's flood leaves another's guaranteed prefixes cached."""

import pytest
import torch

from pdcluster.prefix_store.hashing import hash_prompt_blocks
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.kv_quota import KVQuota, pick_victims

BS = 4


@pytest.mark.parametrize("lru, n, charged, quota, requester, victims, guaranteed", [
    # no quota: least recently released first
    ([(1, "A"), (2, "B"), (3, "A")], 2, {"A": 2, "B": 1}, KVQuota(), "A", [1, 2], 0),
    # B within its guarantee of 1: kept, A's own taken instead
    ([(1, "B"), (2, "A"), (3, "A")], 2, {"A": 2, "B": 1}, KVQuota({"B": 1}), "A", [2, 3], 0),
    # B above its guarantee: its oldest goes, then it is protected again
    ([(1, "B"), (2, "B"), (3, "A")], 2, {"A": 1, "B": 2}, KVQuota({"B": 1}), "A", [1, 3], 0),
    # A at its maximum: its own first, although B's is older and unguaranteed
    ([(1, "B"), (2, "A")], 1, {"A": 4, "B": 1}, KVQuota({}, {"A": 4}), "A", [2], 0),
    # below its maximum: LRU again
    ([(1, "B"), (2, "A")], 1, {"A": 3, "B": 1}, KVQuota({}, {"A": 5}), "A", [1], 0),
    # everything guaranteed: taken anyway (an allocation never stalls), counted
    ([(1, "B"), (2, "C")], 1, {"A": 0, "B": 1, "C": 1}, KVQuota({"B": 5, "C": 5}), "A", [1], 1),
    # the requester's own guaranteed blocks are its to reuse
    ([(1, "B"), (2, "A")], 1, {"A": 1, "B": 1}, KVQuota({"A": 5, "B": 5}), "A", [2], 0),
])
def test_victim_table(lru, n, charged, quota, requester, victims, guaranteed):
    out = pick_victims(lru, n, charged, quota, requester)
    assert out.block_ids == victims and out.num_guaranteed == guaranteed


def test_requester_new_counts_towards_the_maximum():
    lru = [(1, "B"), (2, "A")]
    assert pick_victims(lru, 1, {"A": 3, "B": 1}, KVQuota({}, {"A": 4}), "A", requester_new=1).block_ids == [2]
    assert pick_victims(lru, 1, {"A": 2, "B": 1}, KVQuota({}, {"A": 4}), "A", requester_new=1).block_ids == [1]


def test_shares_become_blocks():
    q = KVQuota.of_shares([("gold", 0.2, 1.0), ("free", 0.0, 0.5)], 100)
    assert q.guaranteed == {"gold": 20} and q.maximum == {"free": 50}
    with pytest.raises(ValueError, match="kv_max"):
        KVQuota.of_shares([("x", 0.6, 0.5)], 100)


def _fill(kv: KVCache, tenant: str, first_token: int, n_blocks: int) -> list[int]:
    """One request of ``tenant``: n_blocks computed, committed, released (cached, evictable)."""
    tokens = list(range(first_token, first_token + n_blocks * BS))
    blocks = kv.allocate(n_blocks, tenant)
    kv.commit(blocks, hash_prompt_blocks(7, tokens, BS), tokens)
    kv.free(blocks)
    return tokens


def _cached_blocks(kv: KVCache, tokens: list[int]) -> int:
    return kv.match_prefix(hash_prompt_blocks(7, tokens, BS), tokens).num_blocks


def test_a_guaranteed_tenant_keeps_its_prefix_while_another_fills_the_pool():
    spec = KVCacheSpec(20, BS, 1, 1, 2, torch.float32)
    guarded = KVCache(spec, quota=KVQuota.of_shares([("B", 0.2, 1.0)], 20))
    plain = KVCache(spec)
    for kv in (guarded, plain):
        b_tokens = _fill(kv, "B", 10_000, 4)          # B: 4 blocks = its 20%
        for i in range(6):                             # A: 6 x 4 blocks through a 20-block pool
            _fill(kv, "A", i * 1000, 4)
        kv.check_integrity()
        kv.b_cached = _cached_blocks(kv, b_tokens)
    assert guarded.b_cached == 4 and plain.b_cached == 0
    assert guarded.charged["B"] == 4 and guarded.num_guaranteed_evictions == 0


def test_a_tenant_at_its_maximum_evicts_its_own_first():
    """Free blocks are anyone's (a maximum never refuses a block nobody else needs);
    once the pool is full, a tenant past its maximum reuses its own cached blocks."""
    spec = KVCacheSpec(12, BS, 1, 1, 2, torch.float32)
    capped = KVCache(spec, quota=KVQuota.of_shares([("A", 0.0, 0.5)], 12))
    plain = KVCache(spec)
    for kv in (capped, plain):
        b_tokens = _fill(kv, "B", 10_000, 2)
        for i in range(8):                            # 16 blocks through the 10 left
            _fill(kv, "A", i * 1000, 2)
        kv.check_integrity()
        kv.b_cached = _cached_blocks(kv, b_tokens)
    assert capped.b_cached == 2 and plain.b_cached == 0
    assert capped.charged == {"A": 10, "B": 2}


def test_the_tiers_see_every_block_the_quota_rule_evicts():
    spec = KVCacheSpec(8, BS, 1, 1, 2, torch.float32)
    kv = KVCache(spec, quota=KVQuota.of_shares([("B", 0.25, 1.0)], 8))
    seen = []
    kv.on_evict = lambda b, h, tokens: seen.append((b, h, tokens))
    b_tokens = _fill(kv, "B", 10_000, 2)
    for i in range(4):
        _fill(kv, "A", i * 1000, 2)
    kv.check_integrity()
    assert _cached_blocks(kv, b_tokens) == 2
    assert len(seen) == 2 and all(len(tokens) == BS and h is not None for _, h, tokens in seen)
