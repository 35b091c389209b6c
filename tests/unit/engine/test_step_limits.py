"""How wide an engine step may go (engine/step_limits.py): the pure rules as
tables, the measured costs they read, and the scheduler taking longer prompt
steps for a lone prompt (nothing decodes, nothing waits) and beside streams whose
TPOT affords them."""

import dataclasses
import math
import types

import pytest
import torch

from pdcluster.services.config import ClusterConfig
from pdcluster.services.engine.config import SchedulerConfig
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.request import FinishReason, Request
from pdcluster.services.sampling_params import greedy
from pdcluster.services.engine import scheduler as scheduler_module
from pdcluster.services.engine.scheduler import Scheduler
from pdcluster.services.engine.step_limits import (MIN_SAMPLE_TOKENS, WIDE_STEP_S, StepCost, StepLimits, Stream,
                                                   step_limits, widest_step)

# A colocated replica's scheduler as the cluster config builds it (services/config.py)
COLOCATED = SchedulerConfig(max_num_batched_tokens=320, prefill_chunk_size=256, borrowed_prefill_tokens=128,
                            long_prefill_tokens=512,
                            wide_step_tokens=1024)
FAST, SLOW = 0.25e-3, 2.3e-3  # seconds a token: AMX on 2 cores, AVX2 on 2 cores (measured, step_limits.py)


@pytest.mark.parametrize("config,borrowing,lone,cost,expected", [
    # a lone prompt, fast kernels: the step goes as wide as the cap (0.3 s / 0.25 ms = 1200 > 1024)
    (COLOCATED, False, True, FAST, StepLimits(1024, 1024, 1024)),
    # anything else on the replica (a stream decoding, a prompt waiting): the caps
    (COLOCATED, False, False, FAST, StepLimits(320, 320, 256)),
    # nothing measured yet: no wider step
    (COLOCATED, False, True, None, StepLimits(320, 320, 256)),
    # slow kernels: 0.3 s holds 130 tokens, fewer than the caps already allow
    (COLOCATED, False, True, SLOW, StepLimits(320, 320, 256)),
    # in between: as many tokens as fit in WIDE_STEP_S
    (COLOCATED, False, True, 0.5e-3, StepLimits(600, 600, 600)),
    # on borrowed cores: what the replica computes in WIDE_STEP_S, at least borrowed_prefill_tokens
    (COLOCATED, True, True, FAST, StepLimits(1024, 1024, 1024)),
    (COLOCATED, True, False, FAST, StepLimits(320, 320, 256)),
    (COLOCATED, True, True, SLOW, StepLimits(320, 130, 256)),
    (COLOCATED, True, True, None, StepLimits(320, 128, 256)),
    (SchedulerConfig(max_num_batched_tokens=1024, prefill_chunk_size=1024), True, False, 0.5e-3,
     StepLimits(1024, 600, 1024)),
    # costs no clock gives: denormal (as fast as can be: the caps), zero, negative, NaN, infinite (nothing measured)
    (COLOCATED, True, True, 5e-324, StepLimits(1024, 1024, 1024)),
    (COLOCATED, True, True, 0.0, StepLimits(320, 128, 256)),
    (COLOCATED, True, True, -1.0, StepLimits(320, 128, 256)),
    (COLOCATED, True, True, float("nan"), StepLimits(320, 128, 256)),
    (COLOCATED, True, True, float("inf"), StepLimits(320, 128, 256)),
    # the rule off (a prefill replica: its steps are whole already)
    (SchedulerConfig(max_num_batched_tokens=1024, prefill_chunk_size=1024), False, True, FAST,
     StepLimits(1024, 1024, 1024)),
])
def test_a_step_goes_wide_only_for_a_lone_prompt_and_within_its_time(config, borrowing, lone, cost, expected):
    assert step_limits(config, borrowing, lone, cost) == expected


def test_the_cost_a_token_is_smoothed_over_steps_big_enough_to_say():
    cost = StepCost()
    cost.observe(MIN_SAMPLE_TOKENS - 1, 1.0)  # a few decode rows: fixed costs, not a token's
    assert cost.seconds_per_token is None
    cost.observe(1000, 0.25)
    assert cost.seconds_per_token == pytest.approx(0.25e-3)
    cost.observe(1000, 0.5)
    assert 0.25e-3 < cost.seconds_per_token < 0.5e-3
    before = cost.seconds_per_token
    for seconds in (0.0, -1.0, float("nan"), float("inf")):  # a clock that did not move, or nonsense: ignored
        cost.observe(1000, seconds)
    assert cost.seconds_per_token == before


def test_wide_step_settings_are_checked():
    with pytest.raises(ValueError, match="wide_step_tokens"):
        SchedulerConfig(wide_step_tokens=-1)
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="wide_step_tpot_s"):
            SchedulerConfig(wide_step_tpot_s=bad)


@pytest.mark.parametrize("tpot_slo_s", [float("inf"), 1e308, 1e-300])
def test_any_tpot_slo_the_cluster_config_takes_gives_an_engine_config(tpot_slo_s):
    """admission.tpot_slo_s only has to be > 0: the replicas' wide-step TPOT follows it, inf included
    (no stream then limits a step), never a start-up error about a setting the user did not write."""
    cluster = ClusterConfig.model_validate({"mode": "colocated", "admission": {"tpot_slo_s": tpot_slo_s}})
    tpot = cluster.engine_config(cluster.colocated).scheduler.wide_step_tpot_s
    assert tpot == tpot_slo_s * cluster.admission.ttft_headroom
    assert widest_step([Stream(0.0, 1, 32)], tpot, DECODE_STEP, TOKEN, 8192) >= 0


def _scheduler() -> Scheduler:
    kv = KVCache(KVCacheSpec(512, 16, 1, 1, 2, torch.float32))
    s = Scheduler(COLOCATED, kv, hash_seed=42)
    s.step_cost.seconds_per_token = FAST
    return s


def _step(s: Scheduler):
    out = s.schedule()
    s.update(out, {e.request.request_id: 7 for e in out.scheduled if e.samples})
    return out


def test_a_lone_prompt_takes_wide_steps_and_anything_beside_it_brings_the_caps_back():
    s = _scheduler()
    a = Request("a", list(range(3000)), greedy(4))
    s.add(a)
    assert [e.num_new_tokens for e in _step(s).prefills] == [1024]
    b = Request("b", list(range(5000, 5100)), greedy(4))
    s.add(b)  # a short prompt waits: the step is capped, b goes in the same step
    out = _step(s)
    assert sorted((e.request.request_id, e.num_new_tokens) for e in out.prefills) == [("a", 220), ("b", 100)]
    assert b.output_token_ids == [7]
    out = _step(s)  # b decodes: a's share stays capped
    assert [e.request.request_id for e in out.decodes] == ["b"]
    assert [(e.request.request_id, e.num_new_tokens) for e in out.prefills] == [("a", 256)]
    s.finish(b, FinishReason.ABORT)
    assert [e.num_new_tokens for e in _step(s).prefills] == [1024]  # alone again
    assert WIDE_STEP_S / FAST > 1024  # the table's premise


TPOT, DECODE_STEP, TOKEN = 0.08, 0.02, 0.2e-3  # the cluster's TPOT x headroom; 2-core SPR's decode step, s a token


@pytest.mark.parametrize("streams,queued,expected", [
    # nothing decodes: nothing limits the step
    ([], 8192, math.inf),
    # a stream with its 31 gaps ahead: 2.48 s of TPOT, 0.62 s of decode rows, 1.43 s for 7,168 queued tokens
    ([Stream(0.0, 1, 32)], 7168, math.inf),
    # ... behind 16,384 queued tokens it cannot see the queue through: 1.86 s left over its 31 steps
    ([Stream(0.0, 1, 32)], 16384, pytest.approx(1.86 / (TOKEN * 31))),
    # near its end: 3 steps left, 0.08 x 31 - 2.2 - 0.06 = 0.22 s for prompt work, 366 tokens a step
    ([Stream(2.2, 29, 32)], 8192, pytest.approx(0.22 / (TOKEN * 3))),
    # the tightest stream decides
    ([Stream(0.0, 1, 32), Stream(2.2, 29, 32)], 8192, pytest.approx(0.22 / (TOKEN * 3))),
    # past keeping its TPOT whatever the width: no wider step (the caps)
    ([Stream(3.0, 29, 32)], 8192, 0.0),
    # one token asked for, or all of them out: no gap to keep
    ([Stream(5.0, 1, 1), Stream(5.0, 32, 32)], 8192, math.inf),
])
def test_a_step_is_as_wide_as_the_tightest_stream_affords(streams, queued, expected):
    assert widest_step(streams, TPOT, DECODE_STEP, TOKEN, queued) == expected
    assert widest_step(streams, TPOT, DECODE_STEP, 0.0, queued) == math.inf  # prompt work that costs nothing


@pytest.mark.parametrize("widest,lone,expected", [
    (math.inf, False, StepLimits(1024, 1024, 1024)),   # no stream limits it: the cap (0.3 s holds 1,200)
    (600.0, False, StepLimits(600, 600, 600)),
    (100.0, False, StepLimits(320, 320, 256)),         # narrower than the caps: the caps
    (0.0, False, StepLimits(320, 320, 256)),
    (float("nan"), False, StepLimits(320, 320, 256)),
    (-5.0, False, StepLimits(320, 320, 256)),
    (None, False, StepLimits(320, 320, 256)),          # the rule off, or nothing timed yet
    (100.0, True, StepLimits(1024, 1024, 1024)),       # a lone prompt has no stream to keep
])
def test_the_streams_widest_step_sets_the_step_within_its_time(widest, lone, expected):
    assert step_limits(COLOCATED, False, lone, FAST, widest) == expected


def test_the_decode_step_time_is_measured_on_steps_without_prompt_tokens():
    cost = StepCost()
    cost.observe(300, 0.07, prompt_tokens=280)
    assert cost.decode_step_s is None
    cost.observe(16, 0.02)
    assert cost.decode_step_s == pytest.approx(0.02)
    cost.observe(16, 0.04)
    assert 0.02 < cost.decode_step_s < 0.04
    before = cost.decode_step_s
    for seconds in (0.0, float("nan"), float("inf")):
        cost.observe(16, seconds)
    assert cost.decode_step_s == before


def test_a_burst_beside_a_young_stream_takes_wide_steps_and_a_stream_near_its_end_brings_the_caps_back(monkeypatch):
    now = [1000.0]  # the scheduler's clock, stopped: the streams' ages are what the test sets, not wall time
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    kv = KVCache(KVCacheSpec(2048, 16, 1, 1, 2, torch.float32))
    s = Scheduler(dataclasses.replace(COLOCATED, wide_step_tpot_s=TPOT), kv, hash_seed=42)
    s.step_cost.seconds_per_token, s.step_cost.decode_step_s = TOKEN, DECODE_STEP
    a = Request("a", list(range(100)), greedy(32))
    s.add(a)
    _step(s)
    assert a.output_token_ids == [7] and a.first_token_s is not None
    for i in range(4):  # a burst of 4 x 1,024-token prompts: a sees them through within its TPOT
        s.add(Request(f"p{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 1024)), greedy(32)))
    out = _step(s)
    assert [e.request.request_id for e in out.decodes] == ["a"]
    assert sum(e.num_new_tokens for e in out.prefills) == 1023  # the wide cap, less a's decode row
    now[0] += 2.4  # a has spent its TPOT (0.08 x 31 = 2.48 s) on its first gap: the caps
    out = _step(s)
    assert sum(e.num_new_tokens for e in out.prefills) <= COLOCATED.max_num_batched_tokens - 1
