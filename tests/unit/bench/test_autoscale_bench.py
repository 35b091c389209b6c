"""bench/load/autoscale.py's arithmetic: the ramp it picks, the best ratio
the ramp allows, replica-seconds and direction changes."""

from __future__ import annotations

import pytest

from bench.load.autoscale import (
    PEAK_FACTOR, best_ratio, default_low_rps, direction_changes, phases, replica_seconds, rule_need, static_for_peak,
)


@pytest.mark.parametrize("slowdown", [1.0, 1.5, 2.0])
def test_the_default_peak_is_the_lowest_that_needs_one_replica_more_than_the_low(slowdown):
    low = default_low_rps(slowdown)
    peak = low * PEAK_FACTOR
    assert sum(rule_need(peak, slowdown)) > sum(rule_need(low, slowdown))
    below = round(peak - 0.05, 2)
    assert sum(rule_need(below, slowdown)) <= sum(rule_need(below / PEAK_FACTOR, slowdown))


def test_a_slower_machine_gets_a_lower_peak_and_the_opening_deployment_is_the_rules_at_no_load():
    assert default_low_rps(2.0) < default_low_rps(1.5) < default_low_rps(1.0)
    assert rule_need(0.0) == (0, 1)  # the prefill pool at zero, one decode replica that prefills


def test_best_ratio_is_low_replicas_twice_and_peak_replicas_once_over_peak_replicas_thrice():
    ramp = phases(default_low_rps(), 60.0)
    low, peak = sum(rule_need(ramp[0].rps)), sum(rule_need(ramp[1].rps))
    assert best_ratio(ramp) == pytest.approx((2 * low + peak) / (3 * peak))


@pytest.mark.parametrize("samples, expected", [
    ([(0.0, 1, 1), (1.0, 1, 1), (2.0, 1, 2), (3.0, 1, 2)], 2 + 2 + 3),
    ([(0.0, 2, 3)], 0.0),
    ([(0.0, 1, 1), (0.5, 1, 1)], 1.0),
])
def test_replica_seconds_hold_each_sample_until_the_next(samples, expected):
    assert replica_seconds(samples) == pytest.approx(expected)


@pytest.mark.parametrize("moves, changed", [
    ([], {}),
    ([(70.0, "decode", "up"), (130.0, "decode", "down")], {("low again", "decode"): 1}),
    ([(70.0, "decode", "up"), (80.0, "decode", "down"), (90.0, "decode", "up")], {("peak", "decode"): 2}),
    ([(10.0, "prefill", "up"), (70.0, "decode", "up"), (75.0, "prefill", "up")], {}),
])
def test_direction_changes_count_reversals_per_phase_and_pool(moves, changed):
    ramp = phases(1.0, 60.0)
    counts = direction_changes(moves, ramp)
    assert {k: v for k, v in counts.items() if v} == changed


@pytest.mark.parametrize("nominal, samples, static", [
    ((1, 1), [(0.0, 0, 1), (1.0, 0, 2), (2.0, 0, 1)], (0, 2)),  # a whole deployment, never 1 + 2
    ((1, 2), [(0.0, 0, 1), (1.0, 0, 2)], (1, 2)),  # the rule's peak needs more than the run held
    ((1, 1), [(0.0, 1, 1), (1.0, 1, 3)], (1, 3)),
    ((0, 1), [], (0, 1)),
])
def test_the_static_deployment_is_the_largest_one_held_or_the_rules_peak(nominal, samples, static):
    assert static_for_peak(nominal, samples) == static
