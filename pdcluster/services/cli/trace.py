"""`pdcluster trace`: one request's trace from the local JSONL span file, as a
terminal waterfall of its stages.

    pdcluster trace --last                  the most recently finished request
    pdcluster trace --request-id ID         by x-request-id (or the engine's id)
    pdcluster trace --trace-id HEX          by trace id (a unique prefix will do)
    pdcluster trace --list 20               the latest traces, one line each

Rendering is a pure function of the span dicts (``render_waterfall``), so
tests pin its output without a terminal.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from pdcluster.services.cli.tables import plain_table, table_lines

Span = dict[str, Any]
ROOT_NAME = "gateway.request"
BAR_WIDTH = 32


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="draw one request's trace (stages, durations, key attributes)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--last", action="store_true", help="the most recently finished request (default)")
    which.add_argument("--request-id", default=None, help="the request's x-request-id")
    which.add_argument("--trace-id", default=None, help="a trace id, or a unique prefix of one")
    which.add_argument("--list", type=int, default=None, metavar="N", help="list the N latest traces")
    p.add_argument("--file", default=None, help="the span file (default: the running cluster's trace_file, "
                                                "else $PDCLUSTER_TRACE_FILE, else runs/traces/spans.jsonl)")
    p.add_argument("--all-attributes", action="store_true", help="print every attribute under each span")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from pdcluster.observability.exporters import read_span_files
    from pdcluster.observability.tracing import DEFAULT_TRACE_FILE, TRACE_FILE_ENV

    path = Path(args.file or _cluster_trace_file() or os.environ.get(TRACE_FILE_ENV) or DEFAULT_TRACE_FILE)
    if not path.is_file():
        print(f"error: no span file at {path}: start the cluster with tracing on (the default) and send a "
              f"request, or pass --file")
        return 1
    spans, bad = read_span_files(path)
    traces = group_traces(spans)
    if args.list is not None:
        for line in list_traces(traces, args.list):
            print(line)
        return 0
    trace_id = select_trace(traces, request_id=args.request_id, trace_id=args.trace_id)
    if trace_id is None:
        wanted = (f"request id {args.request_id!r}" if args.request_id else
                  f"trace id {args.trace_id!r}" if args.trace_id else "any request")
        print(f"error: no trace for {wanted} in {path} ({len(traces)} traces); see `pdcluster trace --list 20`")
        return 1
    for line in render_waterfall(traces[trace_id], all_attributes=args.all_attributes):
        print(line)
    if bad:
        print(f"({bad} unreadable lines skipped in {path})")
    return 0


# ---- selection ------------------------------------------------------------------
def group_traces(spans: Iterable[Span]) -> dict[str, list[Span]]:
    traces: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        traces[s["trace_id"]].append(s)
    return dict(traces)


def _root(spans: Sequence[Span]) -> Span | None:
    roots = [s for s in spans if s["name"] == ROOT_NAME]
    return min(roots, key=lambda s: s["start_ns"]) if roots else None


def _finished_ns(spans: Sequence[Span]) -> int:
    root = _root(spans)
    return root["end_ns"] if root is not None else max(s["end_ns"] for s in spans)


def select_trace(traces: dict[str, list[Span]], *, request_id: str | None = None,
                 trace_id: str | None = None) -> str | None:
    if trace_id:
        trace_id = trace_id.lower()
        hits = [t for t in traces if t == trace_id] or [t for t in traces if t.startswith(trace_id)]
        return hits[0] if len(hits) == 1 else None
    if request_id:
        def ids(spans: Sequence[Span]) -> set[str]:
            return {str(s["attributes"][k]) for s in spans for k in ("request.id", "request.engine_id")
                    if k in s.get("attributes", {})}
        hits = [t for t, spans in traces.items() if request_id in ids(spans)]
        return max(hits, key=lambda t: _finished_ns(traces[t])) if hits else None
    with_root = [t for t, spans in traces.items() if _root(spans) is not None] or list(traces)
    return max(with_root, key=lambda t: _finished_ns(traces[t])) if with_root else None


def list_traces(traces: dict[str, list[Span]], limit: int) -> list[str]:
    """A header, then the ``limit`` latest traces, one line each."""
    latest = sorted(traces, key=lambda t: _finished_ns(traces[t]), reverse=True)[:max(limit, 0)]
    table = plain_table("started", "trace", ">E2E", ">spans", "request")
    for t in latest:
        spans = traces[t]
        root = _root(spans)
        start = min(s["start_ns"] for s in spans)
        when = dt.datetime.fromtimestamp(start / 1e9).strftime("%Y-%m-%d %H:%M:%S")
        rid = (root or {}).get("attributes", {}).get("request.id", "-")
        table.add_row(when, t, _ms(_finished_ns(spans) - start), str(len(spans)), str(rid))
    return table_lines(table)


# ---- rendering ------------------------------------------------------------------
def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# (attribute, how to show it): the few numbers worth a glance per stage
_DETAILS: tuple[tuple[str, Any], ...] = (
    ("http.response.status_code", lambda v: f"HTTP {v}"),
    ("replica", lambda v: f"@{v}"),
    ("router.policy", lambda v: f"policy {v}"),
    ("router.reason", lambda v: f"({v})"),
    ("prompt.tokens", lambda v: f"prompt {v} tok"),
    ("prompt.cached_tokens", lambda v: f"cached {v} tok"),
    ("cache.hit_blocks", lambda v: f"hit {v} blk"),
    ("kv.blocks_pulled", lambda v: f"pulled {v} blk"),
    ("kv.blocks_reused", lambda v: f"reused {v} blk"),
    ("kv.bytes", lambda v: _bytes(float(v))),
    ("kv.gbps", lambda v: f"{float(v):.2f} GB/s"),
    ("output.tokens", lambda v: f"out {v} tok"),
    ("finish_reason", lambda v: f"finish {v}"),
)


def _details(s: Span) -> str:
    attrs = s.get("attributes", {})
    parts = [fmt(attrs[key]) for key, fmt in _DETAILS if key in attrs]
    if attrs.get("cancelled"):
        parts.append("cancelled")
    if s.get("status") == "ERROR":
        parts.append(f"ERROR {s.get('status_message') or attrs.get('error.type', '')}".rstrip())
    return "  ".join(parts)


def _label(s: Span) -> str:
    pool = s.get("attributes", {}).get("pool")
    return f"{s['name']} [{pool}]" if pool and s["name"] == "router.route" else s["name"]


def _ordered(spans: Sequence[Span]) -> list[tuple[int, Span, bool]]:
    """(depth, span, parent missing) in parent-before-child, start-time order.
    A span whose parent is not in the file (a process that never flushed, or
    the caller's own span upstream) is drawn at the top level."""
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str | None, list[Span]] = defaultdict(list)
    for s in spans:
        parent = s.get("parent_span_id")
        children[parent if parent in by_id else None].append(s)
    out: list[tuple[int, Span, bool]] = []

    def walk(s: Span, depth: int) -> None:
        # The root's parent is the caller's span upstream: expected, not a gap.
        missing = s["name"] != ROOT_NAME and s.get("parent_span_id") is not None \
            and s["parent_span_id"] not in by_id
        out.append((depth, s, missing))
        for child in sorted(children.get(s["span_id"], []), key=lambda c: (c["start_ns"], c["end_ns"])):
            walk(child, depth + 1)

    for top in sorted(children[None], key=lambda c: (c["start_ns"], -c["end_ns"])):
        walk(top, 0)
    return out


def render_waterfall(spans: Sequence[Span], *, width: int = BAR_WIDTH, all_attributes: bool = False) -> list[str]:
    """The waterfall of one trace's spans, as lines of plain text."""
    if not spans:
        return ["(no spans)"]
    root = _root(spans)
    t0 = min(s["start_ns"] for s in spans)
    t_end = max(s["end_ns"] for s in spans)
    e2e_ns = (root["end_ns"] - root["start_ns"]) if root else t_end - t0
    scale = max(t_end - t0, 1)
    rows = _ordered(spans)
    first = rows[0][1]
    rid = (root or {}).get("attributes", {}).get("request.id", "-")
    processes = {(s.get("service"), s.get("pid")) for s in spans}
    lines = [f"trace {first['trace_id']}  request {rid}  E2E {_ms(e2e_ns)}  "
             f"({len(spans)} spans, {len(processes)} processes)", ""]
    table = plain_table("stage", "service", ">offset", ">duration", "", "details")
    for depth, s, missing in rows:
        start, dur = s["start_ns"] - t0, s["end_ns"] - s["start_ns"]
        left = min(round(start / scale * width), width - 1)
        size = max(1, min(round(dur / scale * width), width - left))
        bar = "·" * left + "█" * size + "·" * (width - left - size)
        name = "  " * depth + ("? " if missing else "") + _label(s)
        table.add_row(name, str(s.get("service") or "-"), "+" + _ms(start), _ms(dur), f"|{bar}|", _details(s))
        if all_attributes:
            for key, value in sorted(s.get("attributes", {}).items()):
                table.add_row("", "", "", "", "", f"{key} = {value}")
    lines.extend(table_lines(table))
    lines.append("")
    lines.extend(_summary(spans, root, e2e_ns))
    return lines


def _summary(spans: Sequence[Span], root: Span | None, e2e_ns: int) -> list[str]:
    if root is None:
        return [f"no {ROOT_NAME} span in this trace: total is first start to last end, {_ms(e2e_ns)}"]
    stages = [s for s in spans if s.get("parent_span_id") == root["span_id"]]
    stage_ns = sum(s["end_ns"] - s["start_ns"] for s in stages)
    share = stage_ns / e2e_ns * 100 if e2e_ns > 0 else 0.0
    return [f"stages {_ms(stage_ns)} of E2E {_ms(e2e_ns)} ({share:.1f}%); "
            f"{_ms(max(e2e_ns - stage_ns, 0))} between stages (HTTP, tokenizing, RPC hops)"]


def _cluster_trace_file() -> str | None:
    """The trace_file of the cluster `pdcluster up` runs here (its state file), if it names one."""
    import json

    from pdcluster.services.cli.cluster_runtime import STATE_FILE

    try:
        named = json.loads(STATE_FILE.read_text()).get("config", {}).get("trace_file")
    except (OSError, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) and named.strip().lower() not in ("", "off", "none") else None
