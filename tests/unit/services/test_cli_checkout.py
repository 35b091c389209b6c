"""The CLI without bench/ (installed from the wheel): `pdcluster --help`
imports no subcommand, `pdcluster bench` ends in one line naming the fix,
and `pdcluster plan` plans from flags alone (issue 39)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdcluster.services.cli import checkout
from pdcluster.services.cli.main import COMMANDS, main

# traffic and SLOs as flags: nothing to read from a workload
FLAGS = ["--rps", "2", "--input-mean", "200", "--output-mean", "100", "--ttft", "1", "--tpot", "0.1"]


class _NoBench:
    """A finder that answers for bench as the import system does when no path holds it."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "bench":
            raise ModuleNotFoundError("No module named 'bench'", name="bench")
        return None


@pytest.fixture
def no_bench(monkeypatch):
    """As after `pip install pdcluster-*.whl`: bench is not importable and no checkout is beside pdcluster."""
    for name in [m for m in sys.modules if m == "bench" or m.startswith("bench.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoBench, *sys.meta_path])
    monkeypatch.setattr(checkout, "_checkout_root", lambda: None)


def test_help_imports_no_subcommand():
    code = ("import sys; from pdcluster.services.cli.main import build_parser; build_parser().format_help(); "
            "loaded = [m for m in sys.modules if m.startswith(('bench', 'pdcluster.services.cli.', 'ray'))]; "
            "assert loaded == ['pdcluster.services.cli.main'], loaded")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_is_listed_and_registers_itself(name, capsys):
    # In this process: one interpreter per command took a minute of the suite (each imports Ray);
    # that --help alone imports no subcommand is checked in a fresh interpreter above.
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    out = capsys.readouterr()
    assert done.value.code == 0 and f"usage: pdcluster {name}" in out.out, out.err


def test_bench_without_a_checkout_ends_in_one_line(no_bench):
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--url", "http://127.0.0.1:1"])
    message = str(exit.value.code)
    assert message.startswith("pdcluster bench: error: ") and "checkout" in message and "\n" not in message


def test_the_door_opens_from_a_checkout():
    assert checkout.bench_module("bench.workload").load_workload("tiny").name == "tiny"
    with pytest.raises(ValueError):
        checkout.bench_module("json")


def test_plan_from_flags_needs_no_bench(no_bench, capsys):
    assert main(["plan", *FLAGS]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "reproduce: pdcluster plan" in out and "(from flags)" in out


def test_plan_from_a_workload_without_bench_names_the_fix(no_bench, capsys):
    assert main(["plan", "--rps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdcluster plan: error: --workload mixed") and "checkout" in err and "--tpot" in err
    assert len(err.splitlines()) == 1, err


def test_a_tp_that_splits_no_kv_head_is_refused_without_bench(no_bench, capsys):
    assert main(["plan", *FLAGS, "--model", "llama-3.1-8b", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdcluster plan: error: --tp 3 does not divide the 32 query heads") and len(err.splitlines()) == 1
