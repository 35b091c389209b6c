"""The peer-fetch overhead a replica measures (pdcluster/services/pools/fetch_overhead.py):
the median of its recent fetches, the default before any and again once they are old."""

from __future__ import annotations

from pdcluster.services.pools.fetch_overhead import WINDOW_S, FetchOverhead, overhead_s


def test_the_median_of_recent_samples_else_the_default():
    assert overhead_s([], 100.0, 0.02) == 0.02
    assert overhead_s([(99.0, 0.05), (99.5, 0.09), (100.0, 0.07)], 100.0, 0.02) == 0.07
    assert overhead_s([(100.0 - WINDOW_S - 1, 5.0), (100.0, 0.03)], 100.0, 0.02) == 0.03  # an old one is forgotten
    assert overhead_s([(100.0, -1.0)], 100.0, 0.02) == 0.02  # no negative time


def test_a_replica_tries_again_after_a_quiet_window():
    now = [0.0]
    est = FetchOverhead(0.02, clock=lambda: now[0])
    est.observe(0.3)
    assert est.seconds() == 0.3
    now[0] = WINDOW_S + 1
    assert est.seconds() == 0.02


def test_a_replica_with_peer_fetch_reports_what_its_pulls_cost_to_the_router():
    """Worker.routing_stats carries the figures the fetcher decides with (so the
    router prices a pull as the replica will); without peer fetch, none."""
    from types import SimpleNamespace

    from pdcluster.router.peer_fetch import DEFAULT_PULL_S_PER_BLOCK
    from pdcluster.router.replica_stats import ReplicaStats
    from pdcluster.services.pools.pull_estimate import PullEstimate
    from pdcluster.services.pools.worker import Worker

    estimate = PullEstimate(DEFAULT_PULL_S_PER_BLOCK)
    estimate.observe(20, 0.06)
    fetcher = SimpleNamespace(overhead=FetchOverhead(0.02))
    fetcher.overhead.observe(0.25)
    engine = SimpleNamespace(stats=SimpleNamespace(kv_blocks_free=10, num_running=1))
    replica = SimpleNamespace(aengine=engine, name="w", _prefill_rate_tps=900.0, pull_estimate=estimate,
                              peer_fetch=fetcher)
    stats = ReplicaStats.from_routing_stats(Worker.routing_stats(replica))
    assert (stats.pull_s_per_block, stats.pull_overhead_s) == (0.003, 0.25)
    replica.peer_fetch = None
    stats = ReplicaStats.from_routing_stats(Worker.routing_stats(replica))
    assert (stats.pull_s_per_block, stats.pull_overhead_s) == (None, None)
