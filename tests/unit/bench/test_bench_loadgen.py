"""The streaming client, load generator and report, against a fake
OpenAI-compatible SSE server on 127.0.0.1 (a test of the client code only;
the real-cluster test lives with the integration tests)."""

import json

import pytest
from bench_fake_server import FakeConfig, fake_server

from bench.load.client import chunk_tokens, sse_data
from bench.load.loadgen import run_workload
from bench.load.report import build_report, report_json
from bench.load.schedule import request_plans
from bench.stats import summarize
from bench.tokenizer import WhitespaceTokenizer
from bench.workload import load_workload, with_overrides
from tests.bench_checks import check_percentiles

TOKENIZER = WhitespaceTokenizer()


async def test_tiny_workload_counts_and_percentiles():
    workload = load_workload("tiny")
    with fake_server() as (url, state):
        result = await run_workload(url, workload, TOKENIZER, show_progress=False)
    report = build_report(result, "pytest")
    plans = list(request_plans(workload))
    assert len(result.records) == state.requests == len(plans) == 12
    assert report.overall.ok == 12 and not report.overall.errors
    assert sum(b.requests for b in report.buckets) == 12
    for plan, record in zip(plans, result.records):
        assert record.usage_reported
        assert record.input_tokens == plan.input_tokens  # the server counted our exact prompt
        assert record.output_tokens == plan.output_tokens == len(record.itl_s) + 1
        assert 0 < record.ttft_s < record.e2e_s
    assert all(b["max_tokens"] > 0 and b["stream"] and b["ignore_eos"] for b in state.bodies)
    check_percentiles(report, result)
    assert report.overall.output_tok_s == pytest.approx(sum(r.output_tokens for r in result.records) / result.duration_s)
    assert report.overall.goodput_requests == 12 and report.overall.slos_met


async def test_errors_are_counted_by_kind():
    workload = load_workload("tiny")
    with fake_server(FakeConfig(fail_every=5, break_every=7)) as (url, _):
        result = await run_workload(url, workload, TOKENIZER, show_progress=False)
    report = build_report(result, "pytest")
    assert report.overall.requests == 12
    assert report.overall.errors.get("http_500") == 2  # requests 5 and 10
    broken = {k: v for k, v in report.overall.errors.items() if k != "http_500"}
    assert sum(broken.values()) == 1 and set(broken) <= {"stream_broken", "truncated"}
    assert report.overall.ok == 9 and report.overall.goodput_requests == 9
    check_percentiles(report, result)


async def test_unreachable_server_is_a_connect_error():
    workload = with_overrides(load_workload("tiny"), num_requests=3, model="m")
    result = await run_workload("http://127.0.0.1:9", workload, TOKENIZER, show_progress=False)
    assert [r.error for r in result.records] == ["connect"] * 3


async def test_open_loop_sends_on_schedule_and_chat_works():
    workload = with_overrides(load_workload("tiny"), rate_rps=20.0, duration_s=0.6, endpoint="chat")
    plans = list(request_plans(workload))
    with fake_server() as (url, state):
        result = await run_workload(url, workload, TOKENIZER, show_progress=False)
    assert len(result.records) == len(plans) > 3
    lateness = [r.start_s - p.arrival_s for r, p in zip(result.records, plans)]
    assert max(lateness) < 0.1 and min(lateness) > -0.01
    assert all("messages" in b for b in state.bodies)
    assert all(r.ok and r.output_tokens == len(r.itl_s) + 1 for r in result.records)  # role chunk is no token


async def test_slo_misses_reduce_goodput():
    workload = with_overrides(load_workload("tiny"), num_requests=6)
    data = workload.model_dump()
    data["slos"] = [{"metric": "tpot", "percentile": 99, "max_s": 0.001}]  # fake server steps take >= 2 ms
    strict = type(workload).model_validate(data)
    with fake_server(FakeConfig(step_base_s=0.003)) as (url, _):
        result = await run_workload(url, strict, TOKENIZER, show_progress=False)
    report = build_report(result, "pytest")
    assert report.overall.ok == 6 and report.overall.goodput_requests == 0
    assert not report.overall.slos_met and report.overall.slo_checks[0].observed_s > 0.001


async def test_report_json_holds_the_raw_samples():
    with fake_server() as (url, _):
        result = await run_workload(url, load_workload("tiny"), TOKENIZER, show_progress=False)
    data = json.loads(json.dumps(report_json(build_report(result, "pytest"), result)))
    ttft = [r["ttft_s"] for r in data["records"] if r["error"] is None]
    assert data["overall"]["latency"]["ttft"]["p95"] == pytest.approx(summarize(ttft).p95)
    assert data["command"] == "pytest" and data["workload_spec"]["name"] == "tiny"


def test_sse_parsing_rules():
    assert sse_data(["data: {\"a\": 1}"]) == '{"a": 1}'
    assert sse_data([": keep-alive"]) is None
    assert chunk_tokens({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) == 0
    assert chunk_tokens({"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}) == 1
    assert chunk_tokens({"choices": [{"text": "", "finish_reason": "length"}]}) == 0
    assert chunk_tokens({"choices": [{"text": "", "finish_reason": None}]}) == 1
    assert chunk_tokens({"choices": [], "usage": {"completion_tokens": 3}}) == 0
