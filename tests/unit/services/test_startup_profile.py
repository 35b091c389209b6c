"""A replica's start-up prefill measurement (pdcluster/services/pools/startup_profile.py)
on the bundled model: a positive per-token time, from a scratch engine that leaves the
serving engine untouched (no step, no cached block, no KV event), saved with the model
cache and read back by the next start of the same setting.  No verdict on a time: the
figures are whatever this machine gives."""

from __future__ import annotations

import json
import types

import pytest
import torch

from pdcluster.planning.speed import PrefillModel
from pdcluster.services.config import AutoscaleSpeed, ClusterConfig
from pdcluster.services.engine.config import EngineConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.pools import startup_profile
from pdcluster.services.pools.startup_profile import SAVED_SOURCE, SOURCE, measure_or_none, measure_prefill


@pytest.fixture(scope="module")
def engine_and_events():
    events = []
    return Engine(EngineConfig(num_threads=1, num_kv_blocks=64), on_kv_event=events.append), events


def test_the_measurement_is_a_per_token_time_and_leaves_the_serving_engine_untouched(engine_and_events):
    engine, events = engine_and_events
    measured = startup_profile.measure(engine, tokens=64, repeats=1)
    model = measured.model
    assert model.source == SOURCE and model.per_token_s > 0 and model.overhead_s == 0 and measured.cpu_share > 0
    assert measure_prefill(engine, tokens=64, repeats=1).source == SOURCE
    stats = engine.stats()
    assert (stats.num_steps, stats.prompt_tokens_computed, stats.kv_blocks_cached) == (0, 0, 0)
    assert stats.kv_blocks_free == stats.kv_blocks_total and events == []
    engine.check_integrity()


def test_a_measurement_that_fails_leaves_the_configured_line(engine_and_events, monkeypatch):
    from pdcluster.services.pools import startup_profile

    def fails(*_args, **_kw):
        raise RuntimeError("the scratch engine could not start")

    monkeypatch.setattr(startup_profile, "measure", fails)
    monkeypatch.setattr(startup_profile, "saved_file", lambda _engine: None)
    assert measure_or_none(engine_and_events[0]) is None


def test_a_config_that_names_its_prefill_line_is_not_replaced():
    assert AutoscaleSpeed().measures_at_start()
    assert not AutoscaleSpeed(prefill_per_token_s=0.002).measures_at_start()
    assert not AutoscaleSpeed(measure_at_start=False).measures_at_start()
    cfg = ClusterConfig.model_validate({"autoscaling": {"speed": {"prefill_per_token_s": 0.002}}})
    assert not cfg.autoscaling.speed.measures_at_start()


def test_a_measurement_is_saved_and_the_next_start_of_the_setting_reads_it(engine_and_events, monkeypatch, tmp_path):
    engine = engine_and_events[0]
    saved = tmp_path / "prefill-profile.json"
    monkeypatch.setattr(startup_profile, "saved_file", lambda _engine: saved)
    calls = []

    share = [1.0]

    def measured(_engine):
        calls.append(1)
        return startup_profile.Measurement(PrefillModel(overhead_s=0.0, per_token_s=0.000625, source=SOURCE),
                                           share[0])

    monkeypatch.setattr(startup_profile, "measure", measured)
    share[0] = 0.6   # taken beside a busy neighbour: used, not saved
    assert measure_or_none(engine).per_token_s == 0.000625 and not saved.exists()
    share[0] = 1.0
    calls.clear()
    first = measure_or_none(engine)
    assert first.source == SOURCE and json.loads(saved.read_text())["per_token_s"] == 0.000625
    assert json.loads(saved.read_text())["setting"]["threads"] == torch.get_num_threads()
    again = measure_or_none(engine)
    assert calls == [1] and again.source == SAVED_SOURCE and again.per_token_s == 0.000625
    for bad in ("{not json", '{"per_token_s": -1}', '{"per_token_s": 5}', '{"other": 1}'):
        saved.write_text(bad)   # unreadable or insane: measured again, and saved over
        assert measure_or_none(engine).source == SOURCE
    assert len(calls) == 5 and json.loads(saved.read_text())["per_token_s"] == 0.000625


def test_the_saved_file_is_beside_the_converted_model_and_named_by_the_setting(engine_and_events):
    from pdcluster.services import model_cache

    engine = engine_and_events[0]
    path = startup_profile.saved_file(engine)
    assert path.parent == model_cache.converted(engine.loaded.path) and path.name.startswith("prefill-profile-")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert startup_profile.saved_file(engine) != path   # another thread count is another measurement
    finally:
        torch.set_num_threads(threads)
    assert startup_profile.saved_file(engine) == path


def test_a_model_that_is_not_a_cached_gguf_is_measured_every_start(tmp_path):
    engine = types.SimpleNamespace(loaded=types.SimpleNamespace(path=tmp_path))
    assert startup_profile.saved_file(engine) is None
