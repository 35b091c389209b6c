"""Block manager and local prefix cache: exact block ids and eviction order."""

import pytest
import torch

from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec


def make_cache(n=6, events=None):
    spec = KVCacheSpec(num_blocks=n, block_size=4, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    return KVCache(spec, on_event=(lambda kind, hs: events.append((kind, list(hs)))) if events is not None else None)


def toks(n_blocks, first=0):
    """Token ids of ``n_blocks`` full blocks (block size 4), counting from ``first``."""
    return list(range(first, first + 4 * n_blocks))


def test_pool_is_block_major_and_sized_from_spec():
    kv = make_cache()
    assert kv.kv_pool.shape == (6, 2, 2, 4, 1, 2)
    assert kv.spec.block_bytes == 2 * 2 * 4 * 1 * 2 * 4
    assert kv.kv_pool[3].is_contiguous()


def test_allocate_free_exact_ids_and_all_or_nothing():
    kv = make_cache()
    assert kv.allocate(2) == [0, 1]
    assert kv.allocate(3) == [2, 3, 4]
    assert kv.allocate(2) is None and kv.num_free_blocks == 1  # nothing taken
    kv.free([0, 1])
    assert kv.allocate(3) == [5, 1, 0]  # free list order: 5, then 1 and 0 (freed last-first)
    kv.check_integrity()


def test_double_free_is_refused():
    kv = make_cache()
    b = kv.allocate(1)
    kv.free(b)
    with pytest.raises(ValueError, match="freed more often"):
        kv.free(b)


def test_prefix_hits_take_references_and_evict_lru_tail_first():
    events = []
    kv = make_cache(n=6, events=events)
    a = kv.allocate(3)                       # blocks 0,1,2 of request A
    kv.commit(a, [100, 101, 102], toks(3))
    assert events == [("stored", [100, 101, 102])]
    kv.free(a)                               # released: 2, 1, 0 enter the LRU in that order
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 3
    m = kv.match_prefix([100, 101, 999], toks(3))
    assert m.block_ids == (0, 1) and m.num_evictable == 2
    kv.acquire(m.block_ids)
    assert kv.ref_count(0) == 1 and kv.num_free_blocks == 4
    # Free blocks 3,4,5 go first, then the evictable block 2 (hash 102).
    assert kv.allocate(4) == [3, 4, 5, 2]
    assert events[-1] == ("evicted", [102])
    assert kv.match_prefix([100, 101, 102], toks(3)).block_ids == (0, 1)
    kv.free([0, 1])
    kv.check_integrity()


def test_eviction_order_is_least_recently_released():
    events = []
    kv = make_cache(n=4, events=events)
    x, y = kv.allocate(2), kv.allocate(2)
    kv.commit(x, [1, 2], toks(2))
    kv.commit(y, [3, 4], toks(2, first=50))
    kv.free(y)   # evictable: 3->blk3? order: block 3 then 2 (tail first)
    kv.free(x)   # then block 1, block 0
    assert kv.allocate(1) == [3]
    assert kv.allocate(1) == [2]
    assert kv.allocate(1) == [1]
    assert [h for kind, hs in events if kind == "evicted" for h in hs] == [4, 3, 2]


def test_duplicate_hash_stays_with_first_block():
    kv = make_cache()
    a, b = kv.allocate(1), kv.allocate(1)
    kv.commit(a, [7], toks(1))
    kv.commit(b, [7], toks(1))
    assert kv.match_prefix([7], toks(1)).block_ids == tuple(a)
    kv.free(b)  # uncached duplicate goes straight to the free list
    kv.free(a)
    kv.check_integrity()
    assert kv.num_cached_blocks == 1


def test_disabled_prefix_caching_never_matches():
    spec = KVCacheSpec(4, 4, 1, 1, 2, torch.float32)
    kv = KVCache(spec, enable_prefix_caching=False)
    a = kv.allocate(1)
    kv.commit(a, [5], toks(1))
    kv.free(a)
    assert kv.match_prefix([5], toks(1)).num_blocks == 0


def test_reset_prefix_cache_drops_only_unreferenced():
    events = []
    kv = make_cache(events=events)
    a, b = kv.allocate(1), kv.allocate(1)
    kv.commit(a + b, [1, 2], toks(2))
    kv.free(a)
    assert kv.reset_prefix_cache() == 1
    assert events[-1] == ("evicted", [1])
    assert kv.match_prefix([2], toks(2)[4:]).block_ids == tuple(b)
    kv.free(b)
    kv.check_integrity()


def test_a_hash_hit_whose_tokens_differ_is_not_reused():
    """Two prompts, one hash (a collision, or a gateway's wrong header): the
    second prompt's block is not the first's."""
    kv = make_cache()
    a = kv.allocate(2)
    kv.commit(a, [100, 101], toks(2))
    kv.free(a)
    other = toks(1) + toks(1, first=90)          # block 0 equal, block 1 differs
    assert kv.match_prefix([100, 101], other).block_ids == (a[0],)
    assert kv.num_hash_mismatches == 1
    assert kv.match_prefix([100, 101], toks(2, first=90)).block_ids == ()  # block 0 differs: nothing
    assert kv.match_prefix([100, 101], toks(2)).block_ids == tuple(a)      # the real owner still hits
    kv.check_integrity()


def test_match_and_commit_need_the_tokens_behind_every_hash():
    kv = make_cache()
    a = kv.allocate(2)
    with pytest.raises(ValueError, match="pass the tokens"):
        kv.commit(a, [1, 2], toks(1))
    with pytest.raises(ValueError, match="pass the tokens"):
        kv.match_prefix([1, 2], toks(1) + [0])


def test_eviction_forgets_the_tokens_with_the_hash():
    kv = make_cache(n=1)
    a = kv.allocate(1)
    kv.commit(a, [9], toks(1))
    kv.free(a)
    assert kv.allocate(1) == a and not kv.is_cached(a[0])
    kv.free(a)
    kv.check_integrity()


def test_spec_refuses_bad_sizes():
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        KVCacheSpec(0, 16, 1, 1, 1, torch.float32)
