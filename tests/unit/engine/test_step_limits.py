"""How wide an engine step may go (engine/step_limits.py): the pure rule as a
table, the measured cost a token it reads, and the scheduler taking longer
prompt steps only for a lone prompt (nothing decodes, nothing waits)."""

import pytest
import torch

from pdcluster.services.engine.config import SchedulerConfig
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.request import FinishReason, Request
from pdcluster.services.engine.sampling_params import greedy
from pdcluster.services.engine.scheduler import Scheduler
from pdcluster.services.engine.step_limits import MIN_SAMPLE_TOKENS, WIDE_STEP_S, StepCost, StepLimits, step_limits

# A colocated replica's scheduler as the cluster config builds it (services/config.py)
COLOCATED = SchedulerConfig(max_num_batched_tokens=320, prefill_chunk_size=256, borrowed_prefill_tokens=128,
                            long_prefill_tokens=512,
                            lone_prompt_step_tokens=1024)
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


def test_lone_prompt_step_tokens_is_checked():
    with pytest.raises(ValueError, match="lone_prompt_step_tokens"):
        SchedulerConfig(lone_prompt_step_tokens=-1)


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
