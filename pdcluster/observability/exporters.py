"""Where a process's spans go: the exporters the standard ``OTEL_*`` variables
ask for, plus the local JSONL file that `pdcluster trace` reads, so nothing
external is needed.

    OTEL_TRACES_EXPORTER      comma list of otlp | console | jsonl | none (unset: JSONL only)
    OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL   http/protobuf (default) | grpc
    OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT   read by the OTLP exporter itself

Several processes (gateway, prefill and decode replicas) append to the same
file, which rotates at a size cap (span_file.py).  Each line goes out in a single ``write()`` on an ``O_APPEND`` file
descriptor: on a local filesystem the kernel serialises appends per inode, so
lines from different processes never interleave (NFS gives no such promise).
``os.write`` is unbuffered, so there is nothing to flush.

One line:

    {"trace_id": "<32 hex>", "span_id": "<16 hex>", "parent_span_id": "<16 hex>" | null,
     "name": "prefill.compute", "kind": "INTERNAL", "start_ns": 1.7e18, "end_ns": ...,
     "attributes": {...}, "status": "UNSET" | "OK" | "ERROR", "status_message": str | null,
     "events": [{"name", "time_ns", "attributes"}], "service": "pdcluster-prefill", "pid": 1234}
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SpanExporter,
                                            SpanExportResult)

from pdcluster.observability.span_file import SpanFile, SpanFileLimits, span_file_paths

log = logging.getLogger("pdcluster.telemetry")

AttributeFilter = Callable[[Mapping[str, Any]], dict[str, Any]]


def span_to_dict(span: ReadableSpan, attribute_filter: AttributeFilter | None = None) -> dict[str, Any]:
    ctx, parent = span.context, span.parent
    attrs = dict(span.attributes or {})
    if attribute_filter is not None:
        attrs = attribute_filter(attrs)
    return {
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": attrs,
        "status": span.status.status_code.name,
        "status_message": span.status.description,
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "service": span.resource.attributes.get("service.name"),
        "pid": os.getpid(),
    }


class JsonlSpanExporter(SpanExporter):
    """Appends spans to ``path`` (created 0600 with its parent directories),
    rotated at a size cap (span_file.py)."""

    def __init__(self, path: str | Path, attribute_filter: AttributeFilter | None = None,
                 limits: SpanFileLimits | None = None):
        self.path = Path(path)
        self.attribute_filter = attribute_filter
        self.file = SpanFile(self.path, limits)
        self._warned = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            lines = [(json.dumps(span_to_dict(s, self.attribute_filter), separators=(",", ":"),
                                 default=str) + "\n").encode() for s in spans]
            self.file.append(lines)
            return SpanExportResult.SUCCESS
        except (OSError, TypeError, ValueError) as exc:
            if not self._warned:  # once: a full disk must not flood the logs
                log.warning("cannot append spans to %s: %s; tracing continues without this file",
                            self.path, exc)
                self._warned = True
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.file.close()  # export() and shutdown() may race at exit: the file locks

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # unbuffered writes


def read_span_files(path: str | Path, keep: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """``read_spans`` over the live file and its rotated ones, oldest first."""
    keep = SpanFileLimits.from_env().keep if keep is None else keep
    spans, bad = [], 0
    for p in span_file_paths(Path(path), keep):
        more, more_bad = read_spans(p)
        spans += more
        bad += more_bad
    return spans, bad


def read_spans(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """All spans in a JSONL file and the number of unreadable lines (a crash
    mid-write leaves at most a torn last line)."""
    spans, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(obj, dict) and "trace_id" in obj and "span_id" in obj:
                spans.append(obj)
            else:
                bad += 1
    return spans, bad


def build_processors(service_name: str, jsonl_path: str | Path, attribute_filter: AttributeFilter,
                     jsonl_max_queue: int, jsonl_delay_ms: int) -> list[BatchSpanProcessor]:
    """Batch processors (export off the caller's thread) for every exporter
    asked for; ``jsonl_path`` "off", "none" or "" skips the file."""
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if "none" in names:
        return []
    processors = []
    if str(jsonl_path).strip().lower() not in ("", "off", "none"):
        processors.append(BatchSpanProcessor(JsonlSpanExporter(jsonl_path, attribute_filter),
                                             max_queue_size=jsonl_max_queue, schedule_delay_millis=jsonl_delay_ms))
    for name in names:
        if name == "otlp":
            processors.append(BatchSpanProcessor(otlp_exporter()))
        elif name == "console":
            processors.append(BatchSpanProcessor(ConsoleSpanExporter(service_name=service_name)))
        elif name != "jsonl":
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported here; use otlp, console, jsonl or none", name)
    return processors


def otlp_exporter() -> SpanExporter:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported: use http/protobuf or grpc")
    return OTLPSpanExporter()  # endpoint, headers, TLS and timeout from OTEL_EXPORTER_OTLP_*
