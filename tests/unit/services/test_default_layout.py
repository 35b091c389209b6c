"""What a bare `pdcluster up` starts, by the machine's cores
(pdcluster/services/cli/default_layout.py), and that a named mode or config wins."""

from __future__ import annotations

import argparse

import pytest

from pdcluster.services.cli import default_layout, up


@pytest.mark.parametrize("cores, mode, threads", [(1, "colocated", 1), (2, "colocated", 2),
                                                   (4, "disaggregated", None), (64, "disaggregated", None)])
def test_the_layout_follows_the_cores(cores, mode, threads):
    fields = default_layout.default_layout(cores)
    assert fields.get("mode", "disaggregated") == mode
    if threads:
        pool = fields["colocated"]
        assert pool["num_replicas"] == 1 and pool["num_threads"] == pool["num_cpus"] == threads


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


@pytest.mark.parametrize("cores", [2, 8])
def test_a_bare_up_takes_the_layout_and_a_named_mode_or_config_wins(monkeypatch, tmp_path, cores):
    monkeypatch.setattr(default_layout, "usable_cores", lambda: cores)
    bare = up.load_config(_parse())
    assert bare.mode == ("colocated" if cores <= 2 else "disaggregated")
    if cores <= 2:
        assert (bare.colocated.num_replicas, bare.colocated.num_threads) == (1, cores)
    assert up.load_config(_parse("--mode", "disaggregated")).mode == "disaggregated"
    (tmp_path / "c.yaml").write_text("mode: disaggregated\n")
    assert up.load_config(_parse("--config", str(tmp_path / "c.yaml"))).mode == "disaggregated"
    # a config that tunes something else keeps the machine's layout (it switched a 2-core machine to
    # two 1-core pools); one that names a pool is the user's layout
    (tmp_path / "admission.yaml").write_text("admission: {ttft_headroom: 1.0}\n")
    tuned = up.load_config(_parse("--config", str(tmp_path / "admission.yaml")))
    assert (tuned.mode, tuned.admission.ttft_headroom) == (bare.mode, 1.0)
    assert tuned.colocated == bare.colocated
    (tmp_path / "pools.yaml").write_text("decode: {num_threads: 1}\n")
    assert up.load_config(_parse("--config", str(tmp_path / "pools.yaml"))).mode == "disaggregated"
    assert up.load_config(_parse("--head")).mode == "disaggregated"  # multi-host: pools named by role

