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
