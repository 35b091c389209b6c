"""The peer prefix fetch rule (pdcluster/router/peer_fetch.py): pull only what a peer
holds past this replica's own blocks, never the last token's block, and only
when the pull is predicted cheaper than computing those tokens."""

from __future__ import annotations

import pytest

from pdcluster.prefix_store.index_base import LookupResult
from pdcluster.router.peer_fetch import plan_peer_fetch, pull_s, role_of, should_pull

BS = 16


def test_should_pull_weighs_pull_time_against_recompute_time():
    # 8 blocks: 0.02 + 8 ms to pull against 128 tokens x 0.3 ms = 38 ms to compute
    assert should_pull(8, BS, pull_s_per_block=0.001, recompute_s_per_token=0.0003)
    # one block: the call's overhead (20 ms) outweighs 4.8 ms of compute
    assert not should_pull(1, BS, pull_s_per_block=0.001, recompute_s_per_token=0.0003)
    # a slow link: 8 x 10 ms to pull is more than 38 ms of compute
    assert not should_pull(8, BS, pull_s_per_block=0.010, recompute_s_per_token=0.0003)
    assert not should_pull(0, BS, 0.0, 1.0)
    assert not should_pull(3, BS, 0.0, 1.0, pull_overhead_s=0.0, min_blocks=4)
    assert pull_s(8, 0.001, 0.02) == pytest.approx(0.028)


def test_the_plan_pulls_what_the_best_peer_holds_past_the_local_blocks():
    lookup = LookupResult({"prefill-a": 10, "decode-me": 12, "prefill-b": 6}, num_blocks=12)
    plan = plan_peer_fetch(lookup, "decode-me", local_blocks=2, num_prompt_tokens=12 * BS + 5, block_size=BS)
    assert plan is not None and plan.holder == "prefill-a"  # never itself, however much it holds
    assert (plan.start, plan.num_blocks) == (2, 8)
    assert plan.pull_s < plan.recompute_s


def test_the_last_tokens_block_is_never_pulled():
    lookup = LookupResult({"prefill-a": 8}, num_blocks=8)
    plan = plan_peer_fetch(lookup, "decode-me", 0, num_prompt_tokens=8 * BS, block_size=BS)
    assert plan is not None and plan.num_blocks == 7  # its last token is computed: its logits are the answer


@pytest.mark.parametrize("lookup, local", [
    (LookupResult({"prefill-a": 4}, 8), 4),                        # it has nothing past ours
    (LookupResult({"prefill-a": 8}, 8, degraded=True), 0),         # the index could not answer
    (LookupResult({}, 8), 0),                                      # nobody holds it
    (LookupResult({"prefill-a": 1}, 8), 0),                        # too short to be worth a call
])
def test_no_plan_when_nothing_is_worth_pulling(lookup, local):
    assert plan_peer_fetch(lookup, "decode-me", local, 8 * BS + 1, BS) is None


def test_a_holder_with_the_blocks_in_its_pool_is_preferred_to_one_with_them_on_disk():
    lookup = LookupResult({"prefill-a": 6, "prefill-b": 6}, 6, tier_blocks={"prefill-b": {"disk": 4}})
    assert plan_peer_fetch(lookup, "decode-me", 0, 6 * BS + 1, BS).holder == "prefill-a"
    lookup = LookupResult({"prefill-a": 6, "prefill-b": 6}, 6, tier_blocks={"prefill-a": {"host": 1}})
    assert plan_peer_fetch(lookup, "decode-me", 0, 6 * BS + 1, BS).holder == "prefill-b"


def test_role_of_names_the_holders_pool():
    assert role_of("prefill-abc123") == "prefill"
    assert role_of("decode-x") == "decode" and role_of("colocated-y") == "colocated"
    assert role_of("engine") is None and role_of("gateway-1") is None


def _snapshot(peer_pull_s_per_block):
    from pdcluster.router.snapshot import ReplicaLoad, RequestShape, RoutingSnapshot

    replicas = (ReplicaLoad("a", queued_prefill_tokens=400, prefill_tokens_per_s=1000.0),
                ReplicaLoad("b", queued_prefill_tokens=0, prefill_tokens_per_s=1000.0))
    return RoutingSnapshot(replicas, RequestShape(400, {"a": 320}, block_size=BS,
                                                  peer_pull_s_per_block=peer_pull_s_per_block))


def test_the_router_weighs_a_pull_from_the_holder_against_recomputing():
    from pdcluster.router.cache_aware import cache_aware
    from pdcluster.router.snapshot import estimated_ttft_s, peer_pull

    off, on = _snapshot(None), _snapshot(0.001)
    # Off: b would recompute the 320 tokens a caches (0.32 s, charged twice): a, though busier.
    assert cache_aware(off).replica_id == "a"
    # On: b pulls a's 20 blocks in 0.02 + 20 ms and computes 80 tokens: 0.12 s, no recompute charge.
    assert peer_pull(on.replicas[1], on.request) == (20, pytest.approx(0.04))
    assert estimated_ttft_s(on.replicas[1], on.request) == pytest.approx(0.08 + 0.04)
    assert peer_pull(on.replicas[0], on.request) == (0, 0.0)  # the holder pulls nothing
    assert cache_aware(on).replica_id == "b"
    # A link so slow that the pull costs more than the compute: as if off.
    slow = _snapshot(0.050)
    assert peer_pull(slow.replicas[1], slow.request) == (0, 0.0) and cache_aware(slow).replica_id == "a"


def test_the_router_prices_a_pull_with_the_replicas_own_measured_cost():
    """A replica that measured its fetches dear (a busy holder's lease call) is not
    sent a prefix on the promise of a cheap pull it would then decline."""
    from dataclasses import replace

    from pdcluster.router.cache_aware import cache_aware
    from pdcluster.router.snapshot import RoutingSnapshot, peer_pull

    on = _snapshot(0.001)
    cases = [  # (b's measured pull_s_per_block, pull_overhead_s) -> (blocks b pulls, chosen)
        ((None, None), (20, "b")),     # nothing measured: the request's figure, the default overhead
        ((0.001, 0.02), (20, "b")),    # measured as the defaults
        ((0.001, 0.5), (0, "a")),      # fetches measured at 0.5 s each: dearer than 0.32 s of compute
        ((0.020, 0.02), (0, "a")),     # a slow link: 20 blocks in 0.4 s
    ]
    for (per_block, overhead), (blocks, chosen) in cases:
        b = replace(on.replicas[1], pull_s_per_block=per_block, pull_overhead_s=overhead)
        snap = RoutingSnapshot((on.replicas[0], b), on.request)
        assert peer_pull(b, snap.request)[0] == blocks, (per_block, overhead)
        assert cache_aware(snap).replica_id == chosen, (per_block, overhead)


def test_a_replica_reports_its_measured_pull_cost_only_with_peer_fetch_on():
    from pdcluster.router.replica_stats import ReplicaStats

    stats = ReplicaStats("w", pull_s_per_block=0.002, pull_overhead_s=0.15)
    assert ReplicaStats.from_routing_stats(stats.to_routing_stats()) == stats
    assert "pull_overhead_s" not in ReplicaStats("w").to_routing_stats()
    assert ReplicaStats.from_routing_stats({"pull_overhead_s": "slow", "pull_s_per_block": -1}) == ReplicaStats()


def test_the_pools_routers_know_when_replicas_pull_from_their_peers():
    from pdcluster.services.app import _pool_options
    from pdcluster.services.config import ClusterConfig, PeerFetchSettings

    def router_kwargs(config: ClusterConfig) -> dict:
        opts = _pool_options(config, config.prefill, "prefill", "prefill")
        return opts["request_router_config"].request_router_kwargs

    assert router_kwargs(ClusterConfig())["peer_pull_s_per_block"] is None
    on = ClusterConfig(peer_fetch=PeerFetchSettings(enabled=True))
    assert router_kwargs(on)["peer_pull_s_per_block"] > 0


def test_a_failovers_lost_replicas_are_never_asked():
    lookup = LookupResult({"decode-dead": 10, "prefill-a": 6}, 10)
    plan = plan_peer_fetch(lookup, "decode-me", 0, 10 * BS + 1, BS, avoid=("decode-dead",))
    assert plan.holder == "prefill-a" and plan.num_blocks == 6
    assert plan_peer_fetch(lookup, "decode-me", 0, 10 * BS + 1, BS, avoid=("decode-dead", "prefill-a")) is None


def test_the_lend_wait_is_bounded_in_the_config():
    """A dead or hung holder costs at most the configured wait: no infinite or zero wait is accepted."""
    import pydantic
    import pytest

    from pdcluster.services.config import PeerFetchSettings

    for bad in (float("inf"), float("nan"), 1e300, 0.0, -1.0, "soon"):
        with pytest.raises(pydantic.ValidationError):
            PeerFetchSettings(lease_timeout_s=bad)
    assert PeerFetchSettings(lease_timeout_s=60).lease_timeout_s == 60


def test_blocks_a_holder_keeps_only_in_its_tiers_are_pulled_too():
    # decode-x matched 10 blocks, 6 of them only in its host tier: it loads them back and lends 8 past our 2
    lookup = LookupResult({"decode-x": 10}, 10, tier_blocks={"decode-x": {"host": 6}})
    plan = plan_peer_fetch(lookup, "prefill-me", local_blocks=2, num_prompt_tokens=10 * BS + 1, block_size=BS)
    assert plan is not None and (plan.holder, plan.start, plan.num_blocks) == ("decode-x", 2, 8)
    # ... all of them in its tiers, none in its pool: still a holder
    lookup = LookupResult({"decode-x": 10}, 10, tier_blocks={"decode-x": {"host": 5, "disk": 5}})
    plan = plan_peer_fetch(lookup, "prefill-me", 2, 10 * BS + 1, BS)
    assert plan is not None and plan.num_blocks == 8


def test_the_holder_with_more_blocks_wins_whatever_tier_they_sit_in():
    lookup = LookupResult({"decode-x": 10, "prefill-b": 7}, 10, tier_blocks={"decode-x": {"disk": 6}})
    plan = plan_peer_fetch(lookup, "prefill-me", 0, 10 * BS + 1, BS)
    assert plan is not None and (plan.holder, plan.num_blocks) == ("decode-x", 10)
