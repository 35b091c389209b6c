"""Sweep knee finding, endpoint profiling and the two CLI subcommands, against
the fake server (whose step time grows with the number of streams decoding)."""

import argparse
import json

import pytest
from bench_fake_server import FakeConfig, fake_server

from bench.load import cli as cli_bench
from bench.plan.profiling import ProfileSettings, profile_endpoint
from bench.load.report import GroupReport, Report, SloCheck
from bench.load.sweep import find_knee, parse_sweep, run_sweep
from bench.tokenizer import WhitespaceTokenizer
from bench.workload import Sweep, load_workload
from pdcluster.services.cli import plan as cli_plan

TOKENIZER = WhitespaceTokenizer()


def _report(output_tok_s: float, checks: list[SloCheck]) -> Report:
    group = GroupReport("overall", 10, 10, {}, {}, 0, 0, 0.0, output_tok_s, 1.0, 10, 1.0, checks)
    return Report("w", "load", "url", "m", 1.0, group, [], "cmd")


def test_knee_is_the_last_level_within_slos():
    ok, bad = SloCheck("ttft", 99, 1.0, 0.5), SloCheck("ttft", 99, 1.0, 1.5)
    reports = [_report(10, [ok]), _report(20, [ok]), _report(30, [bad]), _report(25, [ok])]
    knee = find_knee([1, 2, 4, 8], reports)
    assert (knee.knee, knee.broke_at, knee.failed_checks, knee.rule) == (2, 4, [bad], "slo")
    assert find_knee([1], [_report(5, [bad])]).knee is None
    assert find_knee([1, 2], [_report(5, [ok]), _report(6, [ok])]).broke_at is None


def test_knee_without_slos_is_throughput_saturation():
    knee = find_knee([1, 2, 4, 8], [_report(10, []), _report(19, []), _report(30, []), _report(31, [])])
    assert (knee.knee, knee.broke_at, knee.rule) == (4, 8, "saturation")


def test_parse_sweep():
    assert parse_sweep("concurrency=4,1,2") == ("concurrency", [1.0, 2.0, 4.0])
    with pytest.raises(ValueError, match="concurrency=1,2,4"):
        parse_sweep("batch=1,2")


async def test_sweep_finds_where_tpot_breaks():
    # one stream: ~5 + 10 = 15 ms per token; four streams: ~45 ms; the SLO sits at 30 ms
    workload = load_workload("tiny")
    data = workload.model_dump()
    data["slos"] = [{"metric": "tpot", "percentile": 99, "max_s": 0.030}]
    workload = type(workload).model_validate(data)
    sweep = Sweep(kind="concurrency", values=[1, 4], num_requests=4)
    with fake_server(FakeConfig(step_base_s=0.005, step_per_seq_s=0.010)) as (url, _):
        result = await run_sweep(url, workload, TOKENIZER, sweep, "pytest", show_progress=False)
    assert [len(r.records) for r in result.results] == [4, 4]
    assert (result.knee.knee, result.knee.broke_at) == (1, 4)
    # same seed at every level: the same requests
    assert [r.input_tokens for r in result.results[0].records] == [r.input_tokens for r in result.results[1].records]


async def test_profile_recovers_the_servers_timing():
    config = FakeConfig(overhead_s=0.01, prefill_tok_s=20_000, step_base_s=0.006, step_per_seq_s=0.002)
    settings = ProfileSettings(prompt_lengths=(100, 400, 800, 1200), repeats=1, batches=(1, 2, 4, 8), decode_tokens=24)
    with fake_server(config) as (url, _):
        profile = await profile_endpoint(url, TOKENIZER, settings, show_progress=False)
    assert profile.model == "fake-model"
    assert 1 / profile.prefill.per_token_s == pytest.approx(20_000, rel=0.25)
    assert [s.batch for s in profile.decode_samples] == [1, 2, 4, 8]
    # the fake's step at batch B is 6 ms + 2 ms x B (plus event-loop overhead)
    assert profile.step.per_seq_s == pytest.approx(0.002, rel=0.35)
    assert profile.step.step_s(8) == pytest.approx(0.022, rel=0.25)


async def test_profile_probes_long_contexts_and_the_replicas_at_once():
    """The fake's steps do not grow with context and its prefill does not slow decoding: a context cost near
    zero and slowdowns near 1 (the probes' plumbing; bench/plan/accuracy.py runs them on the real cluster)."""
    config = FakeConfig(overhead_s=0.01, prefill_tok_s=2_000, step_base_s=0.006, step_per_seq_s=0.002)
    settings = ProfileSettings(prompt_lengths=(100, 400), repeats=1, batches=(1, 2), decode_tokens=24,
                               closed_loop_rounds=0, context_batches=(1, 2), overlap=True, overlap_streams=2)
    with fake_server(config) as (url, _):
        profile = await profile_endpoint(url, TOKENIZER, settings, show_progress=False)
    assert [(c.batch, c.context) for c in profile.context_samples] == [(1, 412.0), (2, 412.0)]
    for c in profile.context_samples:
        assert c.step_s == pytest.approx(profile.step.step_s(c.batch), rel=0.5)
    o = profile.overlap
    assert o is not None and o.streams == 2
    assert 1.0 <= o.decode_slowdown < 1.5 and 1.0 <= o.prefill_slowdown < 1.5
    assert [p.prompt_tokens for p in o.prefill] == [100, 400] and 0.0 <= o.prefill_delay_s < 0.05


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster")
    sub = parser.add_subparsers(dest="command", required=True)
    cli_bench.register(sub)
    cli_plan.register(sub)
    return parser


def test_cli_modules_are_wired_into_pdcluster():
    from pdcluster.services.cli.main import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"bench", "plan"} <= set(commands)


def test_bench_cli_writes_json_and_png(tmp_path, capsys):
    with fake_server() as (url, _):
        args = _parser().parse_args(["bench", "--url", url, "--workload", "tiny", "--tokenizer", "whitespace",
                                     "--out", str(tmp_path), "--no-progress", "--requests", "6"])
        assert args.func(args) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["overall"]["requests"] == 6 and len(data["records"]) == 6
    assert (tmp_path / "report.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "reproduce: pdcluster bench" in out and "observed/target" in out


def test_bench_cli_sweep(tmp_path, capsys):
    with fake_server() as (url, _):
        args = _parser().parse_args(["bench", "--url", url, "--workload", "tiny", "--tokenizer", "whitespace",
                                     "--out", str(tmp_path), "--no-progress", "--sweep", "concurrency=1,2", "--requests", "4"])
        assert args.func(args) == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["levels"] == [1, 2] and [len(r["records"]) for r in data["runs"]] == [4, 4]
    assert (tmp_path / "sweep.png").exists()
    assert "knee" in capsys.readouterr().out


def test_bench_cli_reports_a_down_server(capsys):
    args = _parser().parse_args(["bench", "--url", "http://127.0.0.1:9", "--tokenizer", "whitespace", "--no-progress"])
    assert args.func(args) == 2
    assert "is the server up?" in " ".join(capsys.readouterr().out.split())


def test_plan_cli_prints_formulas_and_json(tmp_path, capsys):
    args = _parser().parse_args(["plan", "--model", "llama-3.1-8b", "--accelerator", "h100-sxm", "--rps", "20",
                                 "--price-per-hour", "3", "--json", str(tmp_path / "plan.json")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "reproduce: pdcluster plan" in out and "formula" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["sections"]["memory"][0]["formula"] == "params 8,030,000,000 x 2 B / tp 1"
    assert data["decode"]["final"] >= 1 and data["prefill"]["final"] >= 1


def test_plan_cli_with_profile(capsys):
    config = FakeConfig(overhead_s=0.005, prefill_tok_s=20_000, step_base_s=0.004, step_per_seq_s=0.001)
    with fake_server(config) as (url, _):
        args = _parser().parse_args(["plan", "--profile", url, "--tokenizer", "whitespace", "--accelerator", "cpu-2core",
                                     "--profile-batches", "1,4", "--profile-prompts", "100,800", "--profile-tokens", "16",
                                     "--tpot", "0.02", "--workload", "decode", "--rps", "2", "--model", "smollm2-135m"])
        assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "measured:" in out and "verify: pdcluster bench" in out and "prediction at B*" in out
