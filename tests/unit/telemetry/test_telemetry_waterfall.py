"""`pdcluster trace`: selecting a trace and drawing its waterfall."""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from pdcluster.services.cli import trace as cli_trace
from pdcluster.services.cli.trace import group_traces, render_waterfall, select_trace

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
TRACE = "ab" * 16


def _span(name: str, span_id: str, parent: str | None, start_ms: float, end_ms: float, trace: str = TRACE,
          service: str = "pdcluster-gateway", **attrs: Any) -> dict[str, Any]:
    return {"trace_id": trace, "span_id": span_id, "parent_span_id": parent, "name": name,
            "start_ns": T0 + int(start_ms * MS), "end_ns": T0 + int(end_ms * MS), "attributes": attrs,
            "status": "UNSET", "status_message": None, "events": [], "service": service, "pid": 1}


def request_spans(trace: str = TRACE, offset_ms: float = 0.0, request_id: str = "req-1") -> list[dict[str, Any]]:
    o = offset_ms
    root = "0" * 15 + "1"
    spans = [
        _span("gateway.request", root, "c" * 16, o + 0, o + 100, trace, **{"request.id": request_id,
              "http.response.status_code": 200, "output.tokens": 32, "finish_reason": "stop"}),
        _span("router.route", "0" * 15 + "2", root, o + 1, o + 2, trace, pool="prefill",
              **{"router.policy": "cache_aware", "replica": "prefill-a"}),
        _span("prefill.queue", "0" * 15 + "3", root, o + 2, o + 5, trace, "pdcluster-prefill"),
        _span("prefill.compute", "0" * 15 + "4", root, o + 5, o + 20, trace, "pdcluster-prefill",
              **{"prompt.tokens": 512, "prompt.cached_tokens": 256, "cache.hit_blocks": 16}),
        _span("router.route", "0" * 15 + "5", root, o + 21, o + 22, trace, pool="decode"),
        _span("kv.transfer", "0" * 15 + "6", root, o + 23, o + 30, trace, "pdcluster-decode",
              **{"kv.bytes": 1048576, "kv.gbps": 0.15, "kv.blocks_pulled": 16}),
        _span("decode.queue", "0" * 15 + "7", root, o + 30, o + 31, trace, "pdcluster-decode"),
        _span("decode.generate", "0" * 15 + "8", root, o + 31, o + 95, trace, "pdcluster-decode",
              **{"output.tokens": 31, "finish_reason": "stop"}),
    ]
    random.Random(0).shuffle(spans)  # file order is finish order across processes, not tree order
    return spans


def _names(lines: list[str]) -> list[str]:
    return [re.split(r"\s{2,}", line.strip())[0] for line in lines[3:] if "|" in line]


def test_waterfall_orders_stages_and_adds_up() -> None:
    lines = render_waterfall(request_spans())
    assert lines[0].startswith(f"trace {TRACE}  request req-1  E2E 100.0 ms  (8 spans, 3 processes)")
    assert _names(lines) == ["gateway.request", "router.route [prefill]", "prefill.queue", "prefill.compute",
                             "router.route [decode]", "kv.transfer", "decode.queue", "decode.generate"]
    row = {name: line for name, line in zip(_names(lines), [ln for ln in lines[3:] if "|" in ln])}
    assert re.search(r"\+5\.0 ms\s+15\.0 ms", row["prefill.compute"])
    assert "prompt 512 tok  cached 256 tok  hit 16 blk" in row["prefill.compute"]
    assert "1.0 MiB  0.15 GB/s" in row["kv.transfer"] and "pulled 16 blk" in row["kv.transfer"]
    assert "policy cache_aware" in row["router.route [prefill]"]
    assert row["gateway.request"].count("█") == cli_trace.BAR_WIDTH
    # 1 + 3 + 15 + 1 + 7 + 1 + 64 = 92 ms of stages inside a 100 ms request
    assert lines[-1].startswith("stages 92.0 ms of E2E 100.0 ms (92.0%); 8.0 ms between stages")


def test_waterfall_tolerates_missing_parents_and_root() -> None:
    spans = [s for s in request_spans() if s["name"] != "prefill.queue"]
    spans.append(_span("prefill.chunk", "9" * 16, "0" * 15 + "3", 3, 4, service="pdcluster-prefill"))
    lines = render_waterfall(spans)
    assert "? prefill.chunk" in _names(lines)  # its parent never reached the file
    no_root = render_waterfall([s for s in spans if s["name"] != "gateway.request"])
    assert no_root[-1].startswith("no gateway.request span in this trace")
    assert render_waterfall([]) == ["(no spans)"]


def test_select_trace_by_last_request_id_and_prefix() -> None:
    older = request_spans("11" * 16, 0, "req-old")
    newer = request_spans("12" * 16, 500, "req-new")
    traces = group_traces(older + newer + [_span("stray", "f" * 16, None, 900, 901, "99" * 16)])
    assert select_trace(traces) == "12" * 16  # the stray trace has no gateway.request
    assert select_trace(traces, request_id="req-old") == "11" * 16
    assert select_trace(traces, request_id="nope") is None
    assert select_trace(traces, trace_id="1111") == "11" * 16
    assert select_trace(traces, trace_id="1") is None  # ambiguous prefix
    header, *latest = cli_trace.list_traces(traces, 2)
    assert header.split() == ["started", "trace", "E2E", "spans", "request"]
    assert [line.split()[2] for line in latest] == ["99" * 16, "12" * 16]  # latest finished first
    assert latest[1].endswith("req-new")


def test_cli_prints_the_last_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in request_spans()) + '{"torn')
    parser = argparse.ArgumentParser()
    cli_trace.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["trace", "--last", "--file", str(path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "decode.generate" in out and "E2E 100.0 ms" in out and "1 unreadable lines" in out
    args = parser.parse_args(["trace", "--request-id", "missing", "--file", str(path)])
    assert args.func(args) == 1
    assert "no trace for request id 'missing'" in capsys.readouterr().out
