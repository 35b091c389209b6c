"""Start-up profiles saved with the model cache (pdcluster/services/pools/profile_store.py):
the fastest of SAMPLES measurements is kept and then reused; the key separates weights,
settings and machines; a damaged or unwritable file costs only the reuse.  Then the
replica's start-up path (startup_profile.start_up_profiles) with measurements counted
by a stand-in, and once on the bundled model."""

from __future__ import annotations

import dataclasses
import os

import pytest

from pdcluster.planning.speed import PrefillModel, StepModel
from pdcluster.services.engine.config import EngineConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.pools import profile_store, startup_profile
from pdcluster.services.pools.profile_store import (SAMPLES, SAVED_SOURCE, ProfileStore, SavedProfiles,
                                                    engine_settings, fold, machine_identity, profile_key,
                                                    profile_store_for, reusable)
from pdcluster.services.pools.startup_profile import SOURCE, start_up_profiles

FAST = PrefillModel(overhead_s=0.0, per_token_s=2e-4, per_token2_s=1e-8, source=SOURCE)
SLOW = PrefillModel(overhead_s=0.0, per_token_s=4e-4, per_token2_s=1e-8, source=SOURCE)
STEP_FAST = StepModel(base_s=0.010, per_seq_s=0.0005, source=SOURCE)
STEP_SLOW = StepModel(base_s=0.020, per_seq_s=0.0010, source=SOURCE)


def test_fold_keeps_the_faster_line_of_each_kind_and_counts_its_samples():
    saved = fold(None, SLOW, None)
    assert saved == SavedProfiles(prefill=SLOW, prefill_samples=1)
    saved = fold(saved, FAST, STEP_SLOW)
    assert (saved.prefill, saved.prefill_samples, saved.step, saved.step_samples) == (FAST, 2, STEP_SLOW, 1)
    saved = fold(saved, SLOW, STEP_FAST)  # a slower prefill does not replace the faster one
    assert (saved.prefill, saved.prefill_samples, saved.step, saved.step_samples) == (FAST, 3, STEP_FAST, 2)


def test_a_line_is_reused_only_after_enough_samples_and_says_so():
    saved = SavedProfiles(prefill=FAST, step=STEP_FAST, prefill_samples=SAMPLES - 1, step_samples=SAMPLES)
    assert reusable(saved, "prefill") is None
    step = reusable(saved, "step")
    assert dataclasses.replace(step, source=SOURCE) == STEP_FAST
    assert step.source == f"{SAVED_SOURCE} (fastest of {SAMPLES})"
    assert reusable(None, "prefill") is None and reusable(SavedProfiles(), "step") is None


def test_the_key_changes_with_what_sets_the_speed_and_only_with_it():
    settings, machine = {"weights": "w1", "dtype": "bfloat16", "num_threads": 2}, {"cpu": "x", "cpus": 2}
    key = profile_key(settings, machine)
    assert key == profile_key(dict(reversed(list(settings.items()))), dict(machine))  # order does not matter
    assert key != profile_key({**settings, "num_threads": 1}, machine)
    assert key != profile_key({**settings, "weights": "w2"}, machine)
    assert key != profile_key(settings, {**machine, "cpus": 4})


def test_the_machine_key_follows_the_code_that_runs_a_step(tmp_path):
    """An edit (or an upgrade) of the engine's or the kernels' Python gives another key, so a
    replica measures the new code instead of reusing the old code's speed."""
    from pdcluster.services.pools.profile_store import PACKAGE_ROOT, STEP_CODE, code_digest

    for folder in ("services/engine", "kernels", "router"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    before = code_digest(tmp_path, STEP_CODE)
    (tmp_path / "router" / "a.py").write_text("x = 2\n")        # not on a step's path
    assert code_digest.__wrapped__(tmp_path, STEP_CODE) == before
    (tmp_path / "kernels" / "a.py").write_text("x = 2\n")
    assert code_digest.__wrapped__(tmp_path, STEP_CODE) != before
    (tmp_path / "kernels" / "a.py").write_text("x = 1\n")
    (tmp_path / "services/engine" / "b.py").write_text("")        # a new file counts too
    assert code_digest.__wrapped__(tmp_path, STEP_CODE) != before
    assert machine_identity()["code"] == code_digest(PACKAGE_ROOT, STEP_CODE)
    assert (PACKAGE_ROOT / "services" / "engine" / "engine.py").exists()  # the digest reads the real sources


def test_the_store_round_trips_and_treats_a_damaged_file_as_absent(tmp_path):
    store = ProfileStore(tmp_path, "k")
    assert store.load() is None
    saved = SavedProfiles(prefill=FAST, step=STEP_SLOW, prefill_samples=2, step_samples=1)
    assert store.save(saved) and store.load() == saved
    assert [p.name for p in store.path.parent.iterdir()] == ["k.json"]  # no temporary file left
    line = '"overhead_s": 0.0, "per_token2_s": 0.0, "source": "x"'
    for damage in ("{not json", '{"prefill": {"per_token_s": "fast"}}', "[]", '{"prefill": {"bogus": 1}}',
                   '{"prefill": {"per_token_s": -0.001, %s}, "prefill_samples": 3}' % line,
                   '{"prefill": {"per_token_s": 0.0, %s}, "prefill_samples": 3}' % line,
                   '{"prefill": {"per_token_s": Infinity, %s}, "prefill_samples": 3}' % line,
                   '{"prefill": {"per_token_s": NaN, %s}, "prefill_samples": 3}' % line,
                   '{"step": {"base_s": 0.01, "per_seq_s": -1, "source": "x"}, "step_samples": 3}',
                   '{"step": {"base_s": 0.01, "per_seq_s": "0", "source": "x"}, "step_samples": 3}',
                   '{"prefill": {"per_token_s": 5e-324, %s}, "prefill_samples": 3}' % line,  # denormal
                   '{"step": {"base_s": 1e-300, "per_seq_s": 0.001, "source": "x"}, "step_samples": 3}',
                   '{"prefill": {"per_token_s": 0.001, %s}, "prefill_samples": -1}' % line):
        store.path.write_text(damage)
        assert store.load() is None, damage


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_store_that_cannot_be_written_reports_it(tmp_path):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles").chmod(0o500)
    try:
        assert ProfileStore(tmp_path, "k").save(SavedProfiles(prefill=FAST, prefill_samples=1)) is False
    finally:
        (tmp_path / "profiles").chmod(0o700)


def test_a_store_under_a_file_reports_it(tmp_path):
    (tmp_path / "profiles").write_text("a file where the directory should be")
    assert ProfileStore(tmp_path, "k").save(SavedProfiles(prefill=FAST, prefill_samples=1)) is False


class _Measurements:
    """Stands in for the two measurements: hands out the given lines in turn, counting calls."""

    def __init__(self, monkeypatch, prefills, steps):
        self.prefills, self.steps = list(prefills), list(steps)
        self.calls = {"prefill": 0, "step": 0}
        monkeypatch.setattr(startup_profile, "measure_or_none", self._prefill)
        monkeypatch.setattr(startup_profile, "measure_step_or_none", self._step)

    def _prefill(self, _engine):
        self.calls["prefill"] += 1
        return self.prefills.pop(0)

    def _step(self, _engine):
        self.calls["step"] += 1
        return self.steps.pop(0)


def test_replicas_measure_until_enough_samples_then_read_the_fastest(tmp_path, monkeypatch):
    measured = _Measurements(monkeypatch, [SLOW, FAST, SLOW], [STEP_SLOW, STEP_SLOW, STEP_FAST])
    store = ProfileStore(tmp_path, "k")
    got = [start_up_profiles(None, prefill=True, step=True, store=store) for _ in range(SAMPLES)]
    # each measuring replica takes the fastest line measured so far, its own included
    assert [g[0] for g in got] == [SLOW, FAST, FAST] and [g[1] for g in got] == [STEP_SLOW, STEP_SLOW, STEP_FAST]
    assert measured.calls == {"prefill": SAMPLES, "step": SAMPLES}
    prefill, step = start_up_profiles(None, prefill=True, step=True, store=store)
    assert measured.calls == {"prefill": SAMPLES, "step": SAMPLES}  # read, not measured
    assert dataclasses.replace(prefill, source=SOURCE) == FAST and prefill.source.startswith(SAVED_SOURCE)
    assert dataclasses.replace(step, source=SOURCE) == STEP_FAST
    assert start_up_profiles(None, prefill=True, step=False, store=store)[1] is None  # a prefill replica: no step


def test_without_a_store_every_replica_measures_and_a_failed_measurement_is_not_saved(tmp_path, monkeypatch):
    measured = _Measurements(monkeypatch, [SLOW, None], [STEP_SLOW])
    assert start_up_profiles(None, prefill=True, step=True, store=None) == (SLOW, STEP_SLOW)
    store = ProfileStore(tmp_path, "k")
    assert start_up_profiles(None, prefill=True, step=False, store=store) == (None, None)
    assert store.load() is None and measured.calls == {"prefill": 2, "step": 1}


def test_the_bundled_model_is_measured_then_read_back(tmp_path, monkeypatch):
    """The real path once: a store for a real engine under a model cache of its own, one short
    measurement (reused after one here: SAMPLES is the stand-ins' business above), then a read
    that measures nothing."""
    monkeypatch.setattr(profile_store, "SAMPLES", 1)
    engine = Engine(EngineConfig(num_threads=1, num_kv_blocks=64))
    monkeypatch.setenv("PDCLUSTER_MODEL_CACHE", str(tmp_path))  # after the load: the store's root only
    store = profile_store_for(engine)
    assert store is not None and store.path.parent == tmp_path / "profiles"
    assert store.path.stem == profile_key(engine_settings(engine), machine_identity())
    real_measure = startup_profile.measure_prefill
    monkeypatch.setattr(startup_profile, "measure_prefill",
                        lambda e: real_measure(e, tokens=32, repeats=1, long_tokens=96))
    prefill, step = start_up_profiles(engine, prefill=True, step=False, store=store)
    assert prefill.source == SOURCE and prefill.per_token_s > 0 and step is None
    monkeypatch.setattr(startup_profile, "measure_prefill", lambda e: pytest.fail("measured again"))
    prefill, _ = start_up_profiles(engine, prefill=True, step=False, store=store)
    assert prefill.source.startswith(SAVED_SOURCE) and prefill == reusable(store.load(), "prefill")
    engine.check_integrity()
