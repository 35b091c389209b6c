"""The race's pure parts (bench/load/race_table.py, vs_peer.py's bookkeeping):
issue 34's target lines, n/a for a peer that did not run, the tables, the
order servers take turns in, and refusals kept out of throughput."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from bench.load.client import RequestRecord
from bench.load.llamacpp_server import ensure_q8_0, missing_reason
from bench.load.race_table import (TARGETS_VS_LLAMACPP, TARGETS_VS_VLLM, Measured, Summary, failure_line,
                                   race_order, ratio_table, ratios, server_table, summarize, target_lines)
from bench.load.servers import last_line, up_command
from bench.load.vs_peer import (COMPARISONS, contestants, parse_args, race_workloads, record_workload,
                                reproduce_command)


def summary(**kw) -> Summary:
    base = dict(a_tok_s=100.0, b_tok_s=50.0, b_tpot_p50_ms=20.0, c_tok_s=16.0, c_ttft_p50_ms=7000.0,
                ready_s=10.0, rss_gib=4.0)
    return Summary(**(base | kw))


def rec(out=128, planned=128, ttft=0.5, e2e=3.0, error=None) -> RequestRecord:
    return RequestRecord(index=0, bucket="b", tenant="t", input_tokens=256, output_tokens=out,
                         planned_output_tokens=planned, start_s=0.0, ttft_s=ttft, e2e_s=e2e, error=error)


def test_targets_vs_vllm_are_issue_34s_goals_met_and_missed():
    peer = summary(a_tok_s=50.0, b_tpot_p50_ms=40.0, c_tok_s=16.0, c_ttft_p50_ms=10000.0, ready_s=100.0, rss_gib=5.0)
    assert target_lines(TARGETS_VS_VLLM, ratios(summary(), peer)) == [
        "target a_c16_tok_s_ratio_vs_vllm: 2.00 (goal >= 1.50) met",
        "target b_c1_tpot_p50_ratio_vs_vllm: 0.50 (goal <= 0.60) met",
        "target c_c8_tok_s_ratio_vs_vllm: 1.00 (goal >= 1.50) missed",
        "target c_c8_ttft_p50_ratio_vs_vllm: 0.70 (goal <= 0.70) met",
        "target launch_to_ready_ratio_vs_vllm: 0.10 (goal <= 0.30) met",
        "target rss_ratio_vs_vllm: 0.80 (goal <= 0.80) met",
    ]


def test_a_peer_that_did_not_run_prints_n_a_missed_for_every_target():
    assert target_lines(TARGETS_VS_LLAMACPP, None) == [
        "target a_c16_tok_s_ratio_vs_llamacpp_bf16: n/a (goal >= 2.50) missed",
        "target c_c8_tok_s_ratio_vs_llamacpp_bf16: n/a (goal >= 4.00) missed",
        "target b_c1_tpot_p50_ratio_vs_llamacpp_bf16: n/a (goal <= 0.90) missed",
    ]


def test_nothing_measured_is_nan_and_misses():
    r = ratios(summarize(Measured()), summary())
    assert math.isnan(r.a_tok_s) and math.isnan(r.ready_s)
    assert target_lines(TARGETS_VS_LLAMACPP, r)[0] == "target a_c16_tok_s_ratio_vs_llamacpp_bf16: nan (goal >= 2.50) missed"


def test_summarize_takes_medians_in_display_units():
    m = Measured(tok_s={"a": [90.0, 110.0, 100.0]}, tpot_p50_b_s=[0.02, 0.03], ttft_p50_c_s=[7.0],
                 ready_s=[10.0], rss_gib=[4.0])
    s = summarize(m)
    assert (s.a_tok_s, s.b_tpot_p50_ms, s.c_ttft_p50_ms) == (100.0, 25.0, 7000.0)
    assert math.isnan(s.b_tok_s)


def test_server_and_ratio_tables():
    ours, peer = summary(), summary(a_tok_s=50.0, b_tok_s=math.nan)
    assert server_table([("ours", ours), ("vLLM", peer)])[:3] == [
        "                                |       ours |       vLLM",
        "(a) 256/128 c16 output tok/s    |      100.0 |       50.0",
        "(b) 256/128 c1 output tok/s     |       50.0 |          -",
    ]
    assert ratio_table([("ours/vLLM", ratios(ours, peer))])[:3] == [
        "ratio                           |  ours/vLLM",
        "(a) 256/128 c16 output tok/s    |      2.00x",
        "(b) 256/128 c1 output tok/s     |          -",
    ]


def test_race_order_runs_every_server_once_per_round_in_the_same_order():
    assert race_order(["ours", "vLLM", "llama.cpp bf16"], 2) == [
        (0, "ours"), (0, "vLLM"), (0, "llama.cpp bf16"), (1, "ours"), (1, "vLLM"), (1, "llama.cpp bf16")]


def test_refusals_are_counted_apart_and_never_as_throughput():
    into = Measured()
    records = [rec(), rec(out=0, ttft=None, e2e=None, error="http_429"), rec(out=100)]
    record_workload("b", records, duration_s=2.0, into=into)
    assert into.tok_s["b"] == [114.0]                      # (128 + 100) / 2 s; the 429 adds nothing
    assert into.failed["b"] == Counter({"http_429": 1}) and into.short["b"] == 1
    assert into.tpot_p50_b_s == [pytest.approx((2.5 / 127 + 2.5 / 99) / 2)]
    assert failure_line("ours", into) == "# ours: failed/refused requests a 0, b 1 (http_429 1), c 0; short answers 1"


def test_a_server_that_did_not_start_says_why():
    m = Measured(failure="did not start: llama-server q4_1 did not start; log's last line: Segmentation fault")
    assert failure_line("llama.cpp q4_1", m) == (
        "# llama.cpp q4_1: did not start: llama-server q4_1 did not start; log's last line: Segmentation fault")


def test_smoke_sends_a_quarter_of_the_requests_in_the_same_shapes():
    full, smoke = race_workloads(), race_workloads(0.25)
    assert [w.stop.num_requests for w in full.values()] == [48, 6, 24]
    assert [w.stop.num_requests for w in smoke.values()] == [12, 2, 6]
    assert [w.arrival.concurrency for w in smoke.values()] == [16, 1, 8]


def test_ours_is_the_bare_pdcluster_up_unless_a_config_is_given():
    bare = up_command(None, 8123)
    assert bare[-4:] == ["pdcluster.services.cli.main", "up", "--port", "8123"] and "--config" not in bare
    tuned = up_command(Path("deploy/race.yaml"), 8123, ("--weight-dtype", "int8"))
    assert tuned[-7:] == ["up", "--config", "deploy/race.yaml", "--port", "8123", "--weight-dtype", "int8"]


def test_a_baseline_checkout_runs_its_own_venvs_pdcluster():
    before = up_command(None, 8123, checkout=Path("/work/before"))
    assert before == ["/work/before/.venv/bin/pdcluster", "up", "--port", "8123"]


def test_the_baseline_column_is_raced_and_compared_without_targets():
    args = parse_args(["--rounds", "1", "--baseline", "../before", "--no-vllm", "--no-llamacpp", "--no-int8"])
    chosen, _ = contestants(args)
    assert [name for name, _ in chosen] == ["ours", "baseline"]
    assert chosen[1][1].checkout == Path("../before").resolve()
    assert ("ours/baseline", "ours", "baseline") in COMPARISONS
    assert reproduce_command(args).endswith("--baseline ../before --no-vllm --no-llamacpp --no-int8")


def test_reproduce_command_names_every_flag_given():
    args = parse_args(["--rounds", "1", "--tuned-config", "deploy/race.yaml", "--no-vllm", "--smoke"])
    assert reproduce_command(args) == ("python -m bench.load.vs_peer --rounds 1 --tuned-config deploy/race.yaml "
                                       "--no-vllm --smoke")


def test_llamacpp_missing_reasons(tmp_path: Path):
    assert "not built" in missing_reason(tmp_path)
    bin_dir = tmp_path / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-server").touch()
    assert "smollm2-bf16.gguf is missing" in missing_reason(tmp_path)
    (tmp_path / "smollm2-bf16.gguf").touch()
    assert missing_reason(tmp_path) is None
    assert "llama-quantize" in ensure_q8_0(tmp_path)        # not built: a reason, not a crash


def test_last_line_skips_blank_tail():
    assert last_line("loading\nSegmentation fault (core dumped)\n\n") == "Segmentation fault (core dumped)"
    assert last_line("") == "(empty)"
