"""Exact choices of every routing policy on hand-built snapshots."""

import pytest

from pdcluster.router.cache_aware import CacheAwarePolicy, cache_aware
from pdcluster.router.decode_policy import decode_by_kv
from pdcluster.router.least_loaded import least_loaded
from pdcluster.router.policy import make_policy, policy_names
from pdcluster.router.round_robin import RoundRobinPolicy
from pdcluster.router.snapshot import ReplicaLoad, RequestShape, RoutingSnapshot, affinity_rank


def load(rid, queued=0, running=0, free=0, rate=1000.0):
    return ReplicaLoad(rid, queued_prefill_tokens=queued, running_requests=running,
                       free_kv_blocks=free, prefill_tokens_per_s=rate)


def snap(*replicas, prompt=1000, matched=None, out=0, key=7):
    return RoutingSnapshot(tuple(replicas), RequestShape(prompt, matched or {}, num_output_tokens=out,
                                                        block_size=16, affinity_key=key))


# -- cache_aware ---------------------------------------------------------------
def test_cache_aware_picks_cached_replica_when_loads_are_close():
    # ttft a = (300 + 200)/1000 = 0.5 s; b = 1.0 s; c = 1.1 s
    d = cache_aware(snap(load("a", 300), load("b", 0), load("c", 100), matched={"a": 800}))
    assert d.replica_id == "a"
    assert d.estimated_ttft_s == pytest.approx(0.5)
    assert d.ranked == ("a", "b", "c")
    assert d.reason.startswith("cache hit 800/1000 tokens")


def test_cache_aware_picks_less_loaded_past_the_imbalance_guard():
    # a drains in 0.7 s > 0 s + 0.5 s: not eligible, although its ttft (0.9 s) is lowest.
    d = cache_aware(snap(load("a", 700), load("b", 0), load("c", 100), matched={"a": 800}))
    assert d.replica_id == "b"
    assert d.estimated_ttft_s == pytest.approx(1.0)
    assert d.ranked == ("b", "c", "a")
    assert d.reason.startswith("imbalance guard: a caches 800 tokens")


def test_cache_aware_guard_boundary_is_inclusive():
    d = cache_aware(snap(load("a", 500), load("b", 0), matched={"a": 800}))
    assert d.replica_id == "a"  # drain 0.5 s == 0 + 0.5 s


def test_cache_aware_guard_is_configurable():
    shape = snap(load("a", 300), load("b", 0), matched={"a": 800})
    assert CacheAwarePolicy(max_extra_queue_s=0.2).choose(shape).replica_id == "b"
    assert CacheAwarePolicy(max_extra_queue_s=0.3).choose(shape).replica_id == "a"


def test_cache_aware_recompute_weight_zero_is_plain_ttft():
    # a: (450 + 200)/1000 = 0.65 s; b: 600/1000... b has 400 cached: (0 + 600)/1000 = 0.6 s
    s = snap(load("a", 450), load("b", 0), matched={"a": 800, "b": 400})
    assert cache_aware(s, recompute_weight=0.0).replica_id == "b"
    # weight 2 charges b for the 400 tokens a already holds: 0.6 + 0.8 = 1.4 s > 0.65 s
    assert cache_aware(s, recompute_weight=2.0).replica_id == "a"


def test_cache_aware_uses_each_replicas_rate():
    # a is slow but cached: 200/500 = 0.4 s; b is fast but cold: 1000/2000 + 2*800/2000 = 1.3 s
    d = cache_aware(snap(load("a", 0, rate=500), load("b", 0, rate=2000), matched={"a": 800}))
    assert d.replica_id == "a"


def test_cache_aware_without_matches_is_shortest_queue():
    d = cache_aware(snap(load("a", 300), load("b", 100), load("c", 200)))
    assert d.replica_id == "b"
    assert d.reason.startswith("no usable cached prefix")


def test_cache_aware_ties_follow_the_prefix_rendezvous_hash():
    ids = ["r0", "r1", "r2", "r3"]
    homes = set()
    for key in range(64):
        forward = cache_aware(snap(*(load(r) for r in ids), key=key)).replica_id
        backward = cache_aware(snap(*(load(r) for r in reversed(ids)), key=key)).replica_id
        assert forward == backward == min(ids, key=lambda r: affinity_rank(key, r))
        homes.add(forward)
    assert homes == set(ids)  # new prefixes spread over every replica


def test_matched_tokens_are_capped_at_the_prompt():
    d = cache_aware(snap(load("a"), load("b"), prompt=100, matched={"a": 5000}))
    assert d.replica_id == "a" and d.estimated_ttft_s == 0.0


# -- round_robin / least_loaded --------------------------------------------------
def test_round_robin_cycles_in_snapshot_order():
    policy = RoundRobinPolicy()
    s = snap(load("a", 900), load("b"), load("c"), matched={"c": 900})
    assert [policy.choose(s).replica_id for _ in range(5)] == ["a", "b", "c", "a", "b"]
    assert policy.choose(s).ranked == ("c", "a", "b")


class FixedSample:
    def __init__(self, *picks):
        self.picks = list(picks)

    def sample(self, population, k):
        return self.picks.pop(0)[:k]


def test_least_loaded_compares_the_two_sampled_replicas():
    s = snap(load("a", 500), load("b", 0), load("c", 100), load("d", 300))
    assert least_loaded(s, FixedSample([0, 3])).replica_id == "d"   # a 0.5 s vs d 0.3 s
    assert least_loaded(s, FixedSample([2, 0])).replica_id == "c"
    d = least_loaded(s, FixedSample([0, 2]))
    assert d.replica_id == "c" and d.ranked == ("c", "b", "d", "a")


def test_least_loaded_breaks_queue_ties_by_running_requests_then_first_sampled():
    s = snap(load("a", 0, running=3), load("b", 0, running=1), load("c", 0, running=1))
    assert least_loaded(s, FixedSample([0, 1])).replica_id == "b"
    assert least_loaded(s, FixedSample([2, 1])).replica_id == "c"


def test_least_loaded_policy_is_reproducible_with_a_seed():
    s = snap(*(load(f"r{i}", queued=i * 10) for i in range(8)))
    a, b = make_policy("least_loaded", seed=3), make_policy("least_loaded", seed=3)
    assert [a.choose(s).replica_id for _ in range(20)] == [b.choose(s).replica_id for _ in range(20)]


# -- decode ------------------------------------------------------------------------
def test_decode_prefers_small_batch_among_replicas_with_room():
    replicas = (load("a", free=10, running=1), load("b", free=100, running=3), load("c", free=50, running=1))
    # needs ceil((100 + 60)/16) = 10 blocks: all fit; batch 1 ties, c has more free blocks
    assert decode_by_kv(snap(*replicas, prompt=100, out=60)).ranked == ("c", "a", "b")
    # needs 20 blocks: a is out
    assert decode_by_kv(snap(*replicas, prompt=100, out=220)).ranked == ("c", "b", "a")


def test_decode_when_nothing_fits_queues_on_most_free_blocks():
    d = decode_by_kv(snap(load("a", free=10), load("b", free=30), prompt=1000, out=0))
    assert d.replica_id == "b"
    assert "no decode replica has 63 free blocks" in d.reason and d.estimated_ttft_s is None


# -- registry / snapshot validation --------------------------------------------------
def test_registry_lists_builtin_policies_and_rejects_unknown():
    assert policy_names() == ["cache_aware", "decode_by_kv", "least_loaded", "round_robin"]
    assert make_policy("cache_aware").uses_prefix_index
    assert not make_policy("round_robin").uses_prefix_index
    with pytest.raises(ValueError, match="use one of"):
        make_policy("fastest")


def test_snapshot_rejects_bad_inputs():
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        load("a", rate=0)
    with pytest.raises(ValueError, match="no replicas"):
        RoutingSnapshot((), RequestShape(10))


def test_cache_aware_ties_prefer_fewer_running_requests():
    d = cache_aware(snap(load("a", running=2), load("b", running=0), load("c", running=1), prompt=0))
    assert d.ranked == ("b", "c", "a")


def test_cache_aware_charges_a_tier_hit_its_load_time_not_a_recompute():
    """Two idle replicas cache the same 512 tokens: one in its device pool, one
    on disk.  The device copy wins by the load time; both beat a replica that
    would recompute them, since a disk block loads far faster than it computes."""
    from pdcluster.router.cache_aware import cache_aware
    from pdcluster.router.snapshot import ReplicaLoad, RequestShape, RoutingSnapshot, estimated_ttft_s, tier_load_s

    loads = tuple(ReplicaLoad(r, prefill_tokens_per_s=1000.0) for r in ("dev", "disk", "none"))
    disk_s = tier_load_s({"disk": 32})
    req = RequestShape(600, {"dev": 512, "disk": 512}, tier_load_s={"disk": disk_s})
    assert estimated_ttft_s(loads[1], req) == pytest.approx(88 / 1000 + disk_s)
    decision = cache_aware(RoutingSnapshot(loads, req))
    assert decision.ranked == ("dev", "disk", "none")
    assert tier_load_s({"host": 2, "disk": 1}, {"host": 0.5, "disk": 2.0}) == 3.0
