"""The autoscaling rule: exact needs from the planner's model, then the
hysteresis (ramp up, ramp down, noise, cool-downs, bounds), replayed on a
fake clock."""

from __future__ import annotations

import math
import random
import re

import pytest

from pdcluster.planning.speed import PrefillModel, StepModel
from pdcluster.services.autoscale.policy import (
    Measurements, PoolMeasurement, PoolState, ScalerState, ScalingRules, decide, decode_batch, decode_need,
    prefill_need,
)

# 50-token prompts: prefill 0.1 + 0.004 x 50 = 0.3 s, 0.2 s of it busy.
PREFILL = PrefillModel(overhead_s=0.1, per_token_s=0.004)
# TPOT budget 0.1 x 0.7 = 0.07 s: B* = (0.07 - 0.04) / 0.005 = 6, step(6) = 0.07 s, 85.7 tok/s per replica.
STEP = StepModel(base_s=0.04, per_seq_s=0.005)
RULES = ScalingRules(bounds=((1, 3), (1, 4)))
PER_REPLICA_TOK_S = 6 / 0.07


def load(now: float, rps: float, *, tok_s: float | None = None, seqs: float | None = None, queued: float = 0.0,
         tpot_p90: float | None = None, ttft_p90: float | None = None, samples: int = 50) -> Measurements:
    """``rps`` requests/s of 50 prompt and 20 output tokens, each decoding for 20 x 0.05 s."""
    tok_s = rps * 20 if tok_s is None else tok_s
    seqs = rps * 20 * 0.05 if seqs is None else seqs
    return Measurements(now_s=now, arrival_rps=rps, prompt_tokens_mean=50, output_tok_s=tok_s,
                        prefill=PoolMeasurement(queued_tokens=queued, latency_p90_s=ttft_p90, latency_samples=samples),
                        decode=PoolMeasurement(sequences=seqs, latency_p90_s=tpot_p90, latency_samples=samples))


def start(prefill: int = 1, decode: int = 1) -> ScalerState:
    return ScalerState(PoolState(prefill), PoolState(decode))


def run(state: ScalerState, loads: list[Measurements], rules: ScalingRules = RULES):
    """Every decision of a replay, and the final state."""
    history = []
    for m in loads:
        decisions, state = decide(m, state, PREFILL, STEP, rules)
        history.append({d.pool: d for d in decisions})
    return history, state


def changes(history, pool: str) -> list[tuple[float, int, int]]:
    return [(i, h[pool].current, h[pool].target) for i, h in enumerate(history) if h[pool].direction != "hold"]


def direction_changes(history, pool: str) -> int:
    dirs = [h[pool].direction for h in history if h[pool].direction != "hold"]
    return sum(a != b for a, b in zip(dirs, dirs[1:]))


# --- the need -------------------------------------------------------------


def test_prefill_need_is_the_smallest_count_whose_queueing_meets_the_ttft_budget():
    # 3 req/s x 0.2 s = 0.6 busy: one replica at rho 0.6 waits 0.6/0.4 x 0.1 = 0.15 s; 0.45 s <= 1.4 s
    need = prefill_need(3.0, 50, 0, PREFILL, RULES)
    assert need.replicas == 1 and "rho 0.60" in need.why
    # 5 req/s: rho 1.0 > 0.8 at one replica; two at rho 0.5 wait 0.1 s
    assert prefill_need(5.0, 50, 0, PREFILL, RULES).replicas == 2
    # a backlog of 1000 queued tokens drains in 1000 x 0.004 = 4 s on one replica: 0.3 + 1.33 s > 1.4 s on
    # three, 0.3 + 1.0 s on four
    assert prefill_need(0.5, 50, 1000, PREFILL, RULES).replicas == 4


def test_prefill_need_says_when_no_count_meets_the_budget():
    slow = PrefillModel(overhead_s=2.0, per_token_s=0.004)
    need = prefill_need(0.1, 50, 0, slow, RULES)
    assert need.replicas == 64 and "alone takes 2.20 s" in need.why


def test_decode_need_is_the_larger_of_throughput_at_b_star_and_littles_law():
    assert decode_batch(STEP, RULES) == 6
    # 100 tok/s / (85.7 x 0.8 = 68.6) = 1.46 -> 2
    assert decode_need(100.0, 3, STEP, RULES).replicas == 2
    # few tokens but 13 sequences in flight (queueing): 13 / 6 -> 3
    assert decode_need(10.0, 13, STEP, RULES).replicas == 3
    assert decode_need(0.0, 0, STEP, RULES).replicas == 1


def test_decode_batch_is_at_least_one_even_when_the_tpot_budget_is_unreachable():
    assert decode_batch(StepModel(base_s=0.2, per_seq_s=0.01), RULES) == 1
    assert decode_batch(STEP, ScalingRules(max_num_seqs=4)) == 4


# --- hysteresis -------------------------------------------------------------


def test_ramp_up_then_down_changes_direction_once_per_pool():
    low, peak = 1.0, 6.0  # decode: 20 tok/s vs 120 tok/s (needs 2); prefill: 0.2 vs 1.2 busy (needs 2)
    loads = ([load(t, low) for t in range(0, 60, 5)] + [load(t, peak) for t in range(60, 120, 5)]
             + [load(t, low) for t in range(120, 240, 5)])
    history, state = run(start(), loads)
    for pool in ("prefill", "decode"):
        assert [(c, t) for _, c, t in changes(history, pool)] == [(1, 2), (2, 1)], pool
        assert direction_changes(history, pool) == 1
    up_at = changes(history, "decode")[0][0]
    assert loads[up_at].now_s == 60  # the first window of the peak
    down_at = changes(history, "decode")[1][0]
    assert loads[down_at].now_s == 140  # low since 120: the 20 s stable spell (the 30 s cool-down passed at 90)
    assert state.decode.replicas == 1 and state.prefill.replicas == 1


def test_noise_around_a_boundary_never_reverses_a_decision():
    rng = random.Random(7)
    # decode need at 3.3 req/s = 66 tok/s / 68.6 = 0.96 -> 1; +-25% noise crosses into 2 now and then
    loads = [load(t, 3.3 * rng.uniform(0.75, 1.25)) for t in range(0, 600, 5)]
    history, _ = run(start(), loads)
    assert len(changes(history, "decode")) <= 1
    assert direction_changes(history, "decode") == 0


def test_up_scale_waits_for_its_cool_down_and_then_goes_straight_to_the_need():
    state = ScalerState(PoolState(1), PoolState(2, last_change_s=95.0))
    history, state = run(state, [load(100, 15.0), load(105, 15.0)])  # 300 tok/s: 300 / 68.6 = 4.4 -> 5 > max 4
    assert history[0]["decode"].direction == "hold" and "cooling down (5 of 10 s)" in history[0]["decode"].reason
    assert (history[1]["decode"].current, history[1]["decode"].target) == (2, 4)  # bounded by max 4
    assert state.decode == PoolState(4, last_change_s=105.0, up_slowdown=1.0)  # no TPOT measured: the model's


def test_down_scale_waits_for_the_stable_spell_and_the_cool_down_after_an_up_scale():
    state = ScalerState(PoolState(1), PoolState(3, last_change_s=0.0))
    history, state = run(state, [load(t, 0.5) for t in (5, 10, 20, 25, 30)])
    reasons = [h["decode"].reason for h in history]
    assert all(h["decode"].direction == "hold" for h in history[:4])
    assert "stable spell (0 of 20 s)" in reasons[0] and "stable spell (15 of 20 s)" in reasons[2]
    assert "cooling down (25 of 30 s)" in reasons[3]
    assert (history[4]["decode"].current, history[4]["decode"].target) == (3, 1)


def test_a_demand_spike_resets_the_stable_spell():
    state = ScalerState(PoolState(1), PoolState(2))
    loads = [load(0, 0.5), load(10, 0.5), load(15, 4.0), load(20, 0.5), load(35, 0.5), load(40, 0.5)]
    history, _ = run(state, loads)
    assert [h["decode"].direction for h in history] == ["hold"] * 5 + ["down"]
    assert loads[5].now_s - loads[3].now_s == 20


def test_the_band_holds_a_demand_that_fits_one_replica_less_only_without_margin():
    # 3 replicas; 130 tok/s needs 2 (130/68.6 = 1.9) but x1.3 = 169 tok/s needs 3: hold, forever
    loads = [load(t, 0, tok_s=130, seqs=2) for t in range(100, 300, 5)]
    history, _ = run(ScalerState(PoolState(1), PoolState(3)), loads)
    assert all(h["decode"].direction == "hold" for h in history)
    assert "within the band: need 2, x1.3 demand needs 3" in history[-1]["decode"].reason


def test_slo_breach_adds_a_replica_when_the_model_thinks_it_is_enough():
    m = load(100, 1.0, tpot_p90=0.15)
    history, state = run(start(), [m])
    d = history[0]["decode"]
    assert (d.need, d.target) == (1, 2)
    assert d.reason.startswith("wanted 2: TPOT p90 0.150 s > SLO 0.1 s over 50 requests")
    # too few samples: no breach
    history, _ = run(start(), [load(100, 1.0, tpot_p90=0.15, samples=3)])
    assert history[0]["decode"].direction == "hold"


def test_slo_breach_blocks_a_down_scale():
    loads = [load(t, 0.5, ttft_p90=3.0) for t in range(100, 200, 5)]
    history, _ = run(ScalerState(PoolState(2), PoolState(1)), loads)
    assert all(h["prefill"].direction != "down" for h in history)


def test_bounds_are_enforced_both_ways():
    history, state = run(ScalerState(PoolState(5), PoolState(0)), [load(0, 1.0)])
    assert (history[0]["prefill"].target, history[0]["decode"].target) == (3, 1)
    assert "outside min/max" in history[0]["prefill"].reason
    # at max: hold, saying what it wanted
    history, _ = run(ScalerState(PoolState(1), PoolState(4)), [load(100, 30.0)])
    assert history[0]["decode"].direction == "hold" and history[0]["decode"].reason.startswith("at max_replicas 4")
    # at min: hold
    history, _ = run(start(), [load(100, 0.0)])
    assert "at min_replicas" in history[0]["decode"].reason


def test_with_replicas_takes_an_outside_resize_and_forgets_the_stable_spell():
    state = ScalerState(PoolState(1), PoolState(2, last_change_s=3.0, below_since_s=5.0))
    assert state.with_replicas("decode", 3).decode == PoolState(3, last_change_s=3.0)


@pytest.mark.parametrize("kwargs,message", [
    ({"headroom": 0}, "headroom must be in (0, 1]"),
    ({"max_utilization": 1.5}, "max_utilization must be in (0, 1]"),
    ({"down_margin": 0.9}, "down_margin must be >= 1"),
    ({"tpot_slo_s": 0}, "tpot_slo_s must be > 0"),
    ({"bounds": ((2, 1), (1, 1))}, "prefill: need 0 <= min_replicas <= max_replicas, max_replicas >= 1, got 2..1"),
    ({"bounds": ((0, 0), (1, 1))}, "prefill: need 0 <= min_replicas <= max_replicas, max_replicas >= 1, got 0..0"),
    ({"bounds": ((1, 1), (0, 1))}, "decode: need 1 <= min_replicas"),
    ({"local_prefill_max_share": 1.0}, "local_prefill_max_share must be in [0, 1)"),
])
def test_rules_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ScalingRules(**kwargs)


def test_decisions_are_a_pure_function_of_their_inputs():
    m, state = load(100, 6.0), start()
    assert decide(m, state, PREFILL, STEP, RULES) == decide(m, state, PREFILL, STEP, RULES)
    assert math.isinf(state.decode.last_change_s)


def test_a_measured_slowdown_calibrates_the_step_model():
    from pdcluster.services.autoscale.policy import PoolMeasurement, decode_slowdown, pool_need

    # 2 replicas, 6 sequences: batch 3 per replica, step(3) = 0.055 s; measured 0.11 s: steps x2
    slow = PoolMeasurement(sequences=6, latency_mean_s=0.11, latency_samples=20, replicas=2)
    assert decode_slowdown(slow, STEP, RULES) == pytest.approx(2.0)
    assert decode_slowdown(PoolMeasurement(sequences=6, latency_mean_s=0.11, latency_samples=3, replicas=2),
                           STEP, RULES) == 1.0  # too few requests to judge
    assert decode_slowdown(PoolMeasurement(sequences=1, latency_mean_s=10.0, latency_samples=20, replicas=1),
                           STEP, RULES) == 4.0  # bounded
    # at x2, B* = (0.035 - 0.04) < 0: 1; 60 tok/s / (1 / 0.09 = 11.1 tok/s x 0.8) = 6.75 -> 7
    m = Measurements(now_s=0, arrival_rps=3, prompt_tokens_mean=50, output_tok_s=60, decode=slow)
    need = pool_need("decode", m, PREFILL, STEP, RULES)
    assert need.replicas == 7 and need.why.endswith("steps x2.00 as measured")
    assert pool_need("decode", Measurements(0, 3, 50, 60, decode=PoolMeasurement(sequences=6)), PREFILL, STEP,
                     RULES).replicas == 1


def test_cool_downs_count_from_when_a_change_is_live():
    state = ScalerState(PoolState(1), PoolState(2, last_change_s=10.0)).changed_at("decode", 70.0)
    assert state.decode == PoolState(2, last_change_s=70.0)


def slowed(now: float, replicas: int, tpot_mean_s: float, tok_s: float = 20.0, seqs: float = 2.0) -> Measurements:
    """Decode measured ``tpot_mean_s`` per token at ``seqs`` sequences over ``replicas`` replicas."""
    return Measurements(now_s=now, arrival_rps=1.0, prompt_tokens_mean=50, output_tok_s=tok_s,
                        decode=PoolMeasurement(sequences=seqs, latency_mean_s=tpot_mean_s, latency_samples=50,
                                               replicas=replicas))


@pytest.mark.parametrize("second, held", [
    # 3 replicas, 3 sequences: step(1) = 0.045 s; measured 0.171 s: x3.8, slower than the x2.5 the up-scale
    # was decided on, and the model alone needs 1
    (slowed(200, 3, 0.171, tok_s=30.0, seqs=3.0), True),
    # x2.0: the up-scale helped; B* 1 at 11.1 tok/s x 0.8: 30 tok/s needs 4, and the rule may add one
    (slowed(200, 3, 0.090, tok_s=30.0, seqs=3.0), False),
    # slower, but demand grew past what the model alone says three replicas carry (300 / 68.6 -> 5)
    (slowed(200, 3, 0.171, tok_s=300.0, seqs=12.0), False),
])
def test_an_up_scale_that_made_steps_slower_holds_the_next_one(second, held):
    # 1 replica, 2 sequences: step(2) = 0.05 s, measured 0.125 s: x2.5 -> B* 1, 20 tok/s needs 3; the model alone 1
    history, state = run(start(1, 1), [slowed(100, 1, 0.125)])
    assert history[0]["decode"].target == 3 and state.decode.up_slowdown == pytest.approx(2.5)
    history, state = run(state, [second])
    decision = history[0]["decode"]
    assert (decision.direction == "hold") == held
    if held:
        assert "made steps slower (x2.50 the model when decided, x3.80 now)" in decision.reason
        assert state.decode.up_slowdown == pytest.approx(2.5)  # kept: the evidence stands until it falls back


def test_a_down_scale_forgets_the_up_scales_slowdown():
    state = ScalerState(PoolState(1), PoolState(3, last_change_s=0.0, up_slowdown=2.5))
    history, state = run(state, [load(t, 0.5) for t in range(100, 200, 5)])
    assert changes(history, "decode") and state.decode.up_slowdown is None


# --- a prefill pool that may go to zero (prefill min_replicas 0) -------------

ZERO = ScalingRules(bounds=((0, 3), (1, 4)))


def test_prefill_goes_to_zero_while_the_prompts_take_a_small_share_of_each_decode_replica():
    # 0.5 req/s x 0.2 s busy = 0.1 of one decode replica <= 0.2: the decode replica prefills
    need = prefill_need(0.5, 50, 0, PREFILL, ZERO, decode_replicas=1)
    assert need.replicas == 0 and "0.10 of each <= 0.2" in need.why
    # 1.9 req/s: 0.38 of one decode replica, 0.19 of each of two
    assert prefill_need(1.9, 50, 0, PREFILL, ZERO, decode_replicas=1).replicas == 1
    assert prefill_need(1.9, 50, 0, PREFILL, ZERO, decode_replicas=2).replicas == 0
    # the same load without the option: the pool keeps its replica
    assert prefill_need(0.5, 50, 0, PREFILL, ZERO).replicas == 1
    # a prompt whose prefill alone misses the TTFT budget never goes local, however rare
    slow = PrefillModel(overhead_s=2.0, per_token_s=0.004)
    assert prefill_need(0.01, 50, 0, slow, ZERO, decode_replicas=4).replicas == 64


def test_the_decode_need_counts_the_prompts_it_prefills_until_calibrated():
    from pdcluster.services.autoscale.policy import Pools, pool_need

    # 3.4 req/s x 20 tokens = 68 tok/s: one replica at 85.7 x 0.8 = 68.6 tok/s suffices without prompts ...
    m = Measurements(0, 3.4, 50, 68.0, decode=PoolMeasurement(sequences=3))
    assert pool_need("decode", m, PREFILL, STEP, ZERO).replicas == 1
    # ... but prefilling 3.4 x 0.2 s = 0.68 of its time leaves 0.32 x 85.7 tok/s
    local = pool_need("decode", m, PREFILL, STEP, ZERO, pools=Pools(decode_replicas=1, prefill_at_zero=True))
    assert local.replicas == 4 and "less 0.68 for its prompts" in local.why
    # a calibrated slowdown already holds the prompts' stalls: not counted twice
    calibrated = Measurements(0, 3.4, 50, 68.0, decode=PoolMeasurement(sequences=3, latency_mean_s=0.07,
                                                                       latency_samples=50, replicas=1))
    assert "less" not in pool_need("decode", calibrated, PREFILL, STEP, ZERO,
                                   pools=Pools(decode_replicas=1, prefill_at_zero=True)).why


def test_prefill_scales_to_zero_at_low_load_and_comes_back_for_the_peak():
    low, peak = 0.5, 6.0
    loads = ([load(t, low) for t in range(0, 90, 5)] + [load(t, peak) for t in range(90, 150, 5)]
             + [load(t, low) for t in range(150, 300, 5)])
    history, state = run(start(1, 1), loads, ZERO)
    moves = changes(history, "prefill")
    # down only after the stable spell (20 s), then up at the peak's first tick, down again after it
    assert [(c, t) for _, c, t in moves] == [(1, 0), (0, 2), (2, 0)]
    assert moves[0][0] * 5 >= 20 and moves[1][0] == 90 // 5
    assert direction_changes(history, "prefill") == 2  # one per phase change
    assert state.prefill.replicas == 0
    # while at zero, the decode pool's need carried the prompts' share
    at_zero = history[moves[0][0] + 1]["decode"]
    assert "for its prompts" in at_zero.reason or at_zero.direction == "hold"


def test_a_ttft_breach_brings_a_zero_prefill_pool_back():
    state = ScalerState(PoolState(0), PoolState(1))
    decisions, _ = decide(load(100.0, 0.5, ttft_p90=2.5), state, PREFILL, STEP, ZERO)
    prefill = decisions[0]
    assert (prefill.current, prefill.target) == (0, 1) and "TTFT p90 2.500 s > SLO 2 s" in prefill.reason


def test_the_calibration_is_kept_until_a_window_has_enough_requests_to_replace_it():
    # 4 finished requests calibrate (a mean, not a p90): x2 as in the test above
    four = PoolMeasurement(sequences=6, latency_mean_s=0.11, latency_samples=4, replicas=2)
    decisions, state = decide(Measurements(0, 3, 50, 60, decode=four), start(1, 2), PREFILL, STEP, RULES)
    assert state.decode.slowdown == pytest.approx(2.0) and "steps x2.00" in decisions[1].reason
    # a window with too few requests (after a scale change, or a quiet spell) keeps x2, not the bare model
    quiet = Measurements(5, 3, 50, 60, decode=PoolMeasurement(sequences=6, latency_samples=1, replicas=2,
                                                              latency_mean_s=0.05))
    decisions, state = decide(quiet, state, PREFILL, STEP, RULES)
    assert state.decode.slowdown == pytest.approx(2.0) and "steps x2.00" in decisions[1].reason
    # the next calibrated window replaces it
    fast = PoolMeasurement(sequences=6, latency_mean_s=0.0825, latency_samples=5, replicas=2)
    _, state = decide(Measurements(10, 3, 50, 60, decode=fast), state, PREFILL, STEP, RULES)
    assert state.decode.slowdown == pytest.approx(1.5)
    # never calibrated: the model as it is
    _, fresh = decide(quiet, start(1, 2), PREFILL, STEP, RULES)
    assert fresh.decode.slowdown is None


def test_the_decode_demand_is_the_arrivals_when_an_overloaded_pool_streams_less():
    # 6 req/s x 20 tokens asked = 120 tok/s, but the one replica streams only the 68 tok/s it can
    m = Measurements(0, 6.0, 50, 68.0, decode=PoolMeasurement(sequences=1), output_tokens_mean=20)
    assert m.output_demand_tok_s == 120.0
    decisions, _ = decide(m, start(3, 1), PREFILL, STEP, RULES)
    assert {d.pool: d.target for d in decisions}["decode"] == 2
    # tokens per request not known yet: what was streamed is the demand
    assert Measurements(0, 6.0, 50, 68.0).output_demand_tok_s == 68.0


def slow_decode(now: float, rps: float, tpot_mean: float) -> Measurements:
    """Short prompts (share 0.2 s x rps), 20 output tokens, decode steps measured at ``tpot_mean``."""
    return Measurements(now, rps, 50, rps * 20, decode=PoolMeasurement(
        sequences=rps * 20 * tpot_mean, latency_mean_s=tpot_mean, latency_samples=20, replicas=1),
        output_tokens_mean=20)


def test_decode_replicas_too_slow_to_prefill_too_bring_the_prefill_pool_back_and_grow():
    # 0.8 req/s: 0.16 of the one decode replica's time in prompts (<= 0.2), but its steps measure x2.3 the
    # model (0.1125 s against step(1.8) = 0.049 s): B* 1, 8.7 tok/s x 0.8 x 0.84 against 16 tok/s asked
    m = slow_decode(100.0, 0.8, 0.1125)
    decisions, state = decide(m, ScalerState(PoolState(0), PoolState(1)), PREFILL, STEP, ZERO)
    p, d = decisions
    assert (p.current, p.target) == (0, 1) and "would need" in p.reason
    # the decode pool grows in the same tick: without the prompts, 16 tok/s / (8.7 x 0.8) = 2.3 replicas
    assert (d.current, d.target) == (1, 3) and "less" not in d.reason
    assert state.decode.slowdown == pytest.approx(0.1125 / 0.049)
    # the same steps at a tenth of the load: each prompt's share and the stream fit, the pool stays at zero
    calm, _ = decide(slow_decode(100.0, 0.1, 0.1125), ScalerState(PoolState(0), PoolState(1)), PREFILL, STEP, ZERO)
    assert [x.target for x in calm] == [0, 1]


def test_a_prefill_pool_whose_decode_replicas_could_not_prefill_too_does_not_go_to_zero():
    # 0.6 req/s: the share (0.06 of each of 2) allows zero, but the measured steps (x2.3) leave no room for
    # the prompts: 2 x 8.7 tok/s x 0.8 x 0.92 against 0.6 x 20 x 1.3 (the band) = 15.6 tok/s
    loads = [slow_decode(t, 0.6, 0.1125) for t in range(0, 120, 5)]
    history, state = run(ScalerState(PoolState(1), PoolState(2)), loads, ZERO)
    assert changes(history, "prefill") == [] and state.prefill.replicas == 1
    # unmeasured (the bare model, share x 1.3 = 0.16): it goes
    history, state = run(start(1, 1), [load(t, 0.6) for t in range(0, 120, 5)], ZERO)
    assert state.prefill.replicas == 0
