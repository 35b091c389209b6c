"""pdcluster/services/pools/pull_estimate.py: the per-block pull time comes from pulls big enough that
their fixed part is a small share, and follows the recent ones."""

from __future__ import annotations

import pytest

from pdcluster.services.pools.pull_estimate import MIN_BLOCKS, WINDOW, PullEstimate, per_block_s


def test_the_default_until_a_big_enough_pull_is_seen():
    est = PullEstimate(default_s=0.001)
    assert est.per_block_s() == 0.001
    est.observe(2, 0.040)  # a two-block hand-off: 20 ms a block, nearly all of it the fixed part
    est.observe(MIN_BLOCKS - 1, 0.070)
    assert est.per_block_s() == 0.001
    est.observe(20, 0.010)
    assert est.per_block_s() == pytest.approx(0.0005)


def test_the_median_outvotes_one_slow_pull():
    samples = [(16, 0.008), (16, 0.009), (32, 0.016), (16, 0.800)]
    assert per_block_s(samples, default_s=1.0) == pytest.approx((0.0005 + 0.0005625) / 2)  # the mean would be 13 ms


def test_only_the_last_window_counts():
    est = PullEstimate(default_s=0.001)
    for _ in range(WINDOW):
        est.observe(10, 0.1)      # 10 ms a block (an old, slow transport)
    for _ in range(WINDOW // 2 + 1):
        est.observe(10, 0.001)    # 0.1 ms a block now
    assert est.per_block_s() == pytest.approx(0.0001)


def test_nonsense_samples_are_ignored():
    est = PullEstimate(default_s=0.002)
    est.observe(10, -1.0)
    est.observe(0, 0.5)
    assert est.per_block_s() == 0.002
