"""The closed-loop prediction bench/plan/accuracy.py checks: the speeds it
builds from a profile (prefill busy time, the decode step at a context,
the long-prompt continuation) as their formulas say, and the prediction's
figures from the played loop."""

from __future__ import annotations

import pytest

from bench.plan.closed_loop import Speeds
from pdcluster.planning.speed import PrefillModel, StepModel
from bench.plan.predict import (
    ContextCost, Gaps, Overlap, PrefillBeyond, decode_step_at, fit_context_cost, predict_closed_loop, prefill_at,
    prefill_beyond, speeds, way_in,
)

STEP = StepModel(base_s=0.04, per_seq_s=0.01)
PREFILL = PrefillModel(overhead_s=0.1, per_token_s=0.01)


def predict(concurrency: int, prompt: int = 50, output: int = 21, gaps: Gaps = Gaps(), requests: int = 4):
    return predict_closed_loop(speeds(STEP, PREFILL, gaps=gaps), concurrency=concurrency,
                               requests_per_client=requests, prompt_tokens=prompt, output_tokens=output)


def test_one_client_is_prefill_then_decode_at_batch_one():
    p = predict(1)
    assert p.ttft_s == pytest.approx(0.6)  # 0.1 + 50 x 0.01
    assert p.tpot_s == pytest.approx(0.05) and p.decode_batch == pytest.approx(20 * 0.05 / 1.6)
    assert p.output_tok_s == pytest.approx(21 / (0.6 + 20 * 0.05))


def test_handoff_and_skew_lengthen_the_gaps():
    p = predict(1, gaps=Gaps(handoff_s=0.2, skew=1.1))
    assert p.tpot_s == pytest.approx(0.05 * 1.1 + 0.2 / 20)
    assert p.output_tok_s == pytest.approx(21 / (0.6 + 20 * 0.055 + 0.2))


def test_more_clients_queue_at_prefill_and_batch_at_decode():
    one, three = predict(1), predict(3)
    assert three.ttft_s >= one.ttft_s and three.decode_batch > 1.5 and three.tpot_s > one.tpot_s
    assert three.output_tok_s > one.output_tok_s


def test_throughput_never_exceeds_what_the_prefill_replica_can_start():
    p = predict(8, prompt=200, output=5, requests=6)  # 2 s busy per request, 0.16 s decoding
    # 8 x 5 tokens / mean E2E: about one request per 2 s (the finite run's phases move it a little)
    assert p.output_tok_s == pytest.approx(5 / 2.0, rel=0.1) and p.prefill_utilization == 1.0


@pytest.mark.parametrize("samples, reference, slope", [
    ([(1, 148.0, 0.05 + 100 * 2e-5)], 48.0, 2e-5),  # one batch: (gap - step(1)) / (1 x 100)
    ([(1, 148.0, 0.05 + 100 * 2e-5), (4, 148.0, 0.08 + 4 * 100 * 2e-5)], 48.0, 2e-5),  # both on the line
    ([(1, 148.0, 0.045)], 48.0, 0.0),  # faster than step(1): no negative cost
    ([], 48.0, 0.0),  # not probed
])
def test_context_cost_is_the_slope_of_the_excess_over_the_step_line(samples, reference, slope):
    assert fit_context_cost(STEP, samples, reference) == ContextCost(pytest.approx(slope), reference)


@pytest.mark.parametrize("batch, context, step", [
    (1, 48.0, 0.05),  # at the reference: the step line
    (2, 148.0, 0.06 + 2 * 1e-4 * 100),
    (1, 0.0, max(0.05 - 1e-4 * 48, 0.04)),  # shorter than the reference: less, never below the base
])
def test_decode_step_grows_per_sequence_with_context(batch, context, step):
    assert decode_step_at(STEP, ContextCost(1e-4, 48.0), batch, context) == pytest.approx(step)


def test_speeds_take_the_busy_part_of_prefill_and_the_measured_slowdowns():
    s = speeds(STEP, PREFILL, gaps=Gaps(handoff_s=0.03, skew=1.2), context=ContextCost(1e-4, 48.0),
               overlap=Overlap(prefill_slowdown=1.3, decode_slowdown=1.4))
    assert isinstance(s, Speeds)
    # the way in: the intercept 0.1 less a forward's fixed 0.04 (the step line's base), which the step carries
    assert s.overhead_s == pytest.approx(0.06) and s.prefill_busy_s(50) == pytest.approx(0.54)
    assert s.decode_step_s(2, 148.0) == pytest.approx((0.06 + 0.02) * 1.2)
    assert (s.handoff_s, s.prefill_slowdown, s.decode_slowdown) == (0.03, 1.3, 1.4)


def test_long_prompts_continue_the_last_measured_segment_when_the_slope_falls():
    # 32 -> 128: 4.2 ms/token; 128 -> 256: 4.06 ms/token (falling, as on AVX2): the last slope holds
    beyond = prefill_beyond([(32, 0.18), (32, 0.20), (128, 0.60), (256, 1.10), (256, 1.14)])
    assert beyond == PrefillBeyond(256, pytest.approx(1.12), pytest.approx((1.12 - 0.60) / 128), 0.0)
    assert prefill_at(PREFILL, 200, beyond) == pytest.approx(PREFILL.time_s(200))  # inside: the fitted line
    assert prefill_at(PREFILL, 512, beyond) == pytest.approx(1.12 + 256 * 0.52 / 128)
    assert prefill_beyond([(32, 0.2), (32, 0.3)]) is None
    s = speeds(STEP, PREFILL, beyond=beyond)
    assert s.prefill_busy_s(512) == pytest.approx(1.12 + 256 * 0.52 / 128 - 0.06)


def test_long_prompts_follow_the_parabola_when_the_slope_rises():
    """Samples of f(n) = 0.03 + 2e-4 n + 3e-7 n^2 (attention's n^2 once the linears are fast) at 32..256:
    the extrapolation recovers f at 512 and 1024 exactly; the last segment's slope alone falls short."""
    def f(n):
        return 0.03 + 2e-4 * n + 3e-7 * n * n

    beyond = prefill_beyond([(n, f(n)) for n in (32, 64, 128, 256) for _ in range(2)])
    assert beyond.curvature_s == pytest.approx(3e-7)
    assert beyond.slope_s == pytest.approx(2e-4 + 2 * 3e-7 * 256)  # f'(256)
    for n in (300, 512, 1024):
        assert prefill_at(PREFILL, n, beyond) == pytest.approx(f(n))
    last_slope = (f(256) - f(128)) / 128
    assert f(256) + last_slope * 256 < 0.93 * f(512)


def test_two_lengths_or_a_cold_sample_do_not_bend_the_extrapolation():
    assert prefill_beyond([(128, 0.6), (256, 1.1)]) == PrefillBeyond(128 * 2, 1.1, pytest.approx(0.5 / 128), 0.0)
    # one cold sample among three at 256 moves the median, not the mean's way
    warm = prefill_beyond([(64, 0.3), (128, 0.6), (256, 1.1), (256, 1.1), (256, 1.1)])
    cold = prefill_beyond([(64, 0.3), (128, 0.6), (256, 1.1), (256, 1.1), (256, 3.0)])
    assert cold == warm


def test_accuracy_cases_send_prompts_no_other_case_sent():
    """The measured runs share one cluster and its prefix cache: no case's
    prompt may start like another case's (or the gap probe's), else the
    measurement skips prefill the prediction charges."""
    from bench.load.prompts import PromptBuilder
    from bench.load.schedule import RequestPlan
    from bench.plan.accuracy import CASES, case_seed, workload
    from bench.tokenizer import WhitespaceTokenizer

    tokenizer = WhitespaceTokenizer()
    for seed in (0, 1):
        starts = []
        for index, case in enumerate((*CASES, CASES[0])):  # the last: the gap probe's seed
            builder = PromptBuilder(workload(case, 8, case_seed(seed, index)), tokenizer)
            for i in range(8 * case.concurrency):
                text = builder.build(RequestPlan(i, "fixed", "default", case.prompt_tokens, 0, 1, None)).text
                starts.append(tuple(text.split()[:8]))
        assert len(set(starts)) == len(starts)


@pytest.mark.parametrize("short, long_, delay, slowdown", [
    # overhead 0.1 s; busy 0.1 s (short) and 0.5 s (long) alone
    ((0.2, 0.25), (0.6, 0.65), 0.05, 1.0),    # the same 50 ms at both lengths: all delay
    ((0.2, 0.22), (0.6, 0.70), 0.0, 1.2),     # 20% of the busy part at both: all slowdown
    ((0.2, 0.275), (0.6, 0.775), 0.05, 1.25),   # 50 ms + 25% of the busy part
    ((0.2, 0.35), (0.6, 0.65), 0.10, 1.0),    # more at the short length than the long: no slowdown below 1
    (None, (0.6, 0.70), 0.0, 1.2),            # one length: all of it slowdown
])
def test_overlap_probe_splits_prefill_delay_from_slowdown(short, long_, delay, slowdown):
    from bench.plan.profiling import OverlapSample, PrefillBeside

    points = ((PrefillBeside(32, *short),) if short else ()) + (PrefillBeside(256, *long_),)
    o = OverlapSample(0.02, 0.02, 2, 0.1, points)
    assert (o.prefill_delay_s, o.prefill_slowdown) == (pytest.approx(delay), pytest.approx(slowdown))


def test_overlap_fit_uses_every_length_least_squares():
    """Four lengths, extra = 13 ms + 0.37 x busy with +-3 ms of noise (the AMX machine's figures): the fit
    recovers both within the noise; the two ends alone would be off by the noise at each."""
    from bench.plan.profiling import OverlapSample, PrefillBeside, split_prefill_extra

    overhead, noise = 0.034, (0.003, -0.003, 0.003, -0.003)
    busy = (0.010, 0.021, 0.036, 0.073)
    points = tuple(PrefillBeside(n, overhead + b, overhead + b + 0.013 + 0.37 * b + e)
                   for n, b, e in zip((32, 64, 128, 256), busy, noise))
    delay, slowdown = split_prefill_extra(points, overhead)
    assert delay == pytest.approx(0.013, abs=0.004) and slowdown == pytest.approx(1.37, abs=0.08)
    assert OverlapSample(0.02, 0.02, 2, overhead, points).prefill_slowdown == slowdown
    assert split_prefill_extra((), overhead) == (0.0, 1.0)


def test_a_streamed_requests_first_token_offset_moves_ttft_not_the_busy_part():
    plain = speeds(STEP, PREFILL)
    s = speeds(STEP, PREFILL, gaps=Gaps(first_token_s=0.02))
    assert s.overhead_s == pytest.approx(plain.overhead_s + 0.02)
    assert s.prefill_busy_s(50) == pytest.approx(plain.prefill_busy_s(50)) == pytest.approx(0.54)
    assert predict_closed_loop(s, concurrency=1, requests_per_client=1, prompt_tokens=50,
                               output_tokens=21).ttft_s == pytest.approx(0.6 + 0.02)


@pytest.mark.parametrize("intercept, base, way", [(0.1, 0.04, 0.06), (0.03, 0.04, 0.0), (0.1, -0.01, 0.1)])
def test_the_way_in_is_the_intercept_less_a_forwards_fixed_time(intercept, base, way):
    assert way_in(PrefillModel(overhead_s=intercept, per_token_s=0.01), StepModel(base_s=base, per_seq_s=0.01)) \
        == pytest.approx(way)


def test_ttft_jitter_is_the_pooled_spread_within_each_length():
    from bench.plan.profiling import PrefillBeside, ttft_jitter

    points = (PrefillBeside(32, 0.05, 0.06, (0.05, 0.07)), PrefillBeside(64, 0.06, 0.08, (0.07, 0.08, 0.09)),
              PrefillBeside(128, 0.07, 0.09, (0.09,)))
    # squares about each mean: 2 x 0.01^2 + 2 x 0.01^2 over 1 + 2 degrees of freedom
    assert ttft_jitter(points) == pytest.approx((4e-4 / 3) ** 0.5)
    assert ttft_jitter(points[2:]) == 0.0 and ttft_jitter(()) == 0.0


def test_jitter_pools_seeded_runs_and_lets_in_phase_clients_queue():
    """Chat c3 on the AMX machine in round figures (prefill 36 ms + 0.3 ms/token, decode step 21 ms + 1.4 ms
    per sequence): without jitter the three clients settle, after their first rounds, into a phase where no
    prompt waits for another's prefill; a spread in the way in (as the probe measures it) lets some collide
    again, and TTFT p50 rises.  Seeded: repeatable."""
    from bench.plan.closed_loop import Workload, simulate

    prefill, step = PrefillModel(overhead_s=0.036, per_token_s=3e-4), StepModel(base_s=0.021, per_seq_s=0.0014)
    alone = 0.036 + 64 * 3e-4

    def queued(s) -> int:
        late = [t for seed in range(32) for t in simulate(s, Workload(3, 8, 64, 48), seed=seed) if t.send_s > 2.0]
        return sum(t.ttft_s > alone + 0.01 for t in late)

    calm, jittered = speeds(step, prefill), speeds(step, prefill, jitter_s=0.01)
    assert queued(calm) == 0 and queued(jittered) > 50
    a, b = (predict_closed_loop(jittered, concurrency=3, requests_per_client=8, prompt_tokens=64, output_tokens=48)
            for _ in range(2))
    assert a == b
    assert a.ttft_s > predict_closed_loop(calm, concurrency=3, requests_per_client=8, prompt_tokens=64,
                                          output_tokens=48).ttft_s
    with pytest.raises(ValueError, match="arrival_jitter_s"):
        speeds(step, prefill, jitter_s=-0.01)


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--requests-per-client", "0"], "--requests-per-client must be >= 1"),
    (["--seed", "x"], "invalid int value"),
])
def test_accuracy_bench_refuses_bad_flags_before_starting_anything(argv, message, capsys):
    from bench.plan.accuracy import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_accuracy_bench_on_a_dead_url_is_one_line_and_exit_1(capsys):
    """Nothing listens on the port: the bench says so in one line (no traceback) and exits 1."""
    from bench.plan.accuracy import main
    from pdcluster.prefix_store.redis_server import free_service_port

    assert main(["--url", f"http://127.0.0.1:{free_service_port()}"]) == 1
    err = capsys.readouterr().err
    assert "bench.plan.accuracy: error: cannot list models" in err and "Traceback" not in err
