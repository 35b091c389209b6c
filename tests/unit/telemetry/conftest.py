"""A fresh tracer per test, exporting to a JSONL file under tmp_path, with
no OTEL_* variables leaking in from the environment."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdcluster.observability import tracing
@pytest.fixture
def span_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER", "PDCLUSTER_TRACING",
                 "PDCLUSTER_TRACE_TEXT", "PDCLUSTER_TRACE_FILE"):
        monkeypatch.delenv(name, raising=False)
    tracing._reset_for_tests()
    path = tmp_path / "traces" / "spans.jsonl"
    yield path
    tracing._reset_for_tests()
