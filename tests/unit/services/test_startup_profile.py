"""A replica's start-up prefill measurement (pdcluster/services/pools/startup_profile.py)
on the bundled model: a positive per-token time, from a scratch engine that leaves the
serving engine untouched (no step, no cached block, no KV event).  No verdict on a
time: the figures are whatever this machine gives."""

from __future__ import annotations

import pytest

from pdcluster.services.config import AutoscaleSpeed, ClusterConfig
from pdcluster.services.engine.config import EngineConfig, SchedulerConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.pools import startup_profile
from pdcluster.services.pools.startup_profile import (SOURCE, measure_or_none, measure_prefill, measure_step,
                                                      long_prompt_tokens, measure_step_or_none, prefill_line,
                                                      step_max_tokens)


@pytest.fixture(scope="module")
def engine_and_events():
    events = []
    return Engine(EngineConfig(num_threads=1, num_kv_blocks=64), on_kv_event=events.append), events


def test_the_measurement_is_a_per_token_time_and_leaves_the_serving_engine_untouched(engine_and_events):
    engine, events = engine_and_events
    model = measure_prefill(engine, tokens=32, repeats=1, long_tokens=96)
    assert model.source == SOURCE and model.per_token_s > 0 and model.per_token2_s >= 0 and model.overhead_s == 0
    stats = engine.stats()
    assert (stats.num_steps, stats.prompt_tokens_computed, stats.kv_blocks_cached) == (0, 0, 0)
    assert stats.kv_blocks_free == stats.kv_blocks_total and events == []
    engine.check_integrity()


def test_the_step_line_is_measured_beside_the_serving_engine_and_leaves_it_untouched(engine_and_events):
    engine, events = engine_and_events
    model = measure_step(engine, batches=(1, 4), repeats=2)
    assert model.source == SOURCE and model.base_s > 0 and model.per_seq_s >= 0
    assert model.step_s(4) >= model.step_s(1) > 0
    stats = engine.stats()
    assert (stats.num_steps, stats.prompt_tokens_computed, stats.kv_blocks_cached) == (0, 0, 0)
    assert stats.kv_blocks_free == stats.kv_blocks_total and events == []
    with pytest.raises(ValueError, match="two batches"):
        measure_step(engine, batches=(4, 4))


def test_every_timed_step_decodes_the_whole_batch_where_prompts_are_prefilled_a_step_at_a_time(monkeypatch):
    """A replica that decodes prefills a few prompt tokens a step beside its streams: here one
    64-token prompt a step, so the first stream decodes while the last three prefill.  Each of the
    warm-up and timed steps must still decode all 4 streams (with repeats + 3 tokens a stream, the
    first streams ended during the timed steps and the "batch" step ran fewer)."""
    engine = Engine(EngineConfig(num_threads=1, num_kv_blocks=64, scheduler=SchedulerConfig(
        max_num_batched_tokens=64, prefill_chunk_size=64)))
    seen = []
    step = Engine.step

    def counting(self):
        seen.append((sum(1 for r in self.scheduler.running if not r.is_finished),
                     all(r.num_computed_tokens >= r.num_prompt_tokens for r in self.scheduler.running),
                     not self.scheduler.waiting))
        return step(self)

    monkeypatch.setattr(Engine, "step", counting)
    assert startup_profile._decode_step_s(engine, 4, 64, repeats=3) > 0
    assert len(seen) >= 4 + 4  # four prefill steps at least, then the warm-up and three timed ones
    assert seen[-4:] == [(4, True, True)] * 4
    assert not engine.has_unfinished()  # the streams are aborted, not left in the engine


def test_a_timed_stream_has_a_token_for_each_prefill_step_the_warm_up_and_the_timed_steps():
    assert step_max_tokens(16, 4) == 16 + 4 + 2
    assert step_max_tokens(1, 4) == 1 + 4 + 2


def test_the_prefill_line_goes_through_both_timed_prompts():
    """t(n) = a n + b n^2 through (256, 57 ms) and (2048, 581 ms) (a 2-thread Sapphire Rapids replica)."""
    a, b = prefill_line(256, 0.057, 2048, 0.581)
    assert a * 256 + b * 256 ** 2 == pytest.approx(0.057) and a * 2048 + b * 2048 ** 2 == pytest.approx(0.581)
    assert b > 0
    assert prefill_line(256, 0.057, 2048, None) == (0.057 / 256, 0.0)       # no long prompt timed
    assert prefill_line(256, 0.057, 256, 0.057) == (0.057 / 256, 0.0)       # none longer than the short one
    assert prefill_line(256, 0.057, 2048, 0.2) == (0.057 / 256, 0.0)        # faster per token when longer: noise
    a, b = prefill_line(256, 0.001, 2048, 10.0)                             # a wild long time: a stays positive
    assert a == pytest.approx(0.001 / 256 * 0.5) and b > 0


def test_a_slow_replica_times_a_shorter_long_prompt():
    assert long_prompt_tokens(256, 0.06, 1536) == 1536   # 2-thread Sapphire Rapids: the whole one
    assert long_prompt_tokens(256, 0.2, 1536) == 640     # about 0.5 s at the short prompt's pace
    assert long_prompt_tokens(256, 0.55, 1536) == 512    # never under twice the short one
    assert long_prompt_tokens(256, 0.0, 1536) == 1536


def test_a_measurement_that_fails_leaves_the_configured_line(engine_and_events, monkeypatch):
    from pdcluster.services.pools import startup_profile

    def fails(*_args, **_kw):
        raise RuntimeError("the scratch engine could not start")

    monkeypatch.setattr(startup_profile, "measure_prefill", fails)
    monkeypatch.setattr(startup_profile, "measure_step", fails)
    assert measure_or_none(engine_and_events[0]) is None
    assert measure_step_or_none(engine_and_events[0]) is None


def test_a_config_that_names_its_prefill_line_is_not_replaced():
    assert AutoscaleSpeed().measures_at_start()
    assert not AutoscaleSpeed(prefill_per_token_s=0.002).measures_at_start()
    assert not AutoscaleSpeed(measure_at_start=False).measures_at_start()
    cfg = ClusterConfig.model_validate({"autoscaling": {"speed": {"prefill_per_token_s": 0.002}}})
    assert not cfg.autoscaling.speed.measures_at_start() and cfg.autoscaling.speed.measures_step_at_start()
    assert AutoscaleSpeed().measures_step_at_start()
    assert not AutoscaleSpeed(step_per_seq_s=0.001).measures_step_at_start()
    assert not AutoscaleSpeed(measure_at_start=False).measures_step_at_start()
