"""Reading back what the tracer wrote (imported by the telemetry tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdcluster.observability import tracing
from pdcluster.observability.exporters import read_spans


def finished_spans(path: Path) -> dict[str, dict[str, Any]]:
    """Flushes the exporters and returns the file's spans by name (names are unique per test)."""
    tracing.force_flush()
    spans, bad = read_spans(path)
    assert bad == 0
    return {s["name"]: s for s in spans}
