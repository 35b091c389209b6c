"""The JSONL exporter: whole lines from several processes appending at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from pdcluster.observability.exporters import read_spans

REPO = Path(__file__).resolve().parents[3]
WRITER = """
import sys, time
from pdcluster.observability import tracing
from pathlib import Path
path, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
tracing.setup_tracing(name, jsonl_path=path)
blob = name * (16384 // len(name))   # 16 KiB lines: far past PIPE_BUF, so atomicity is really tested
Path(path + "." + name + ".ready").touch()
while not Path(path + ".go").exists():   # both writers start together
    time.sleep(0.001)
for i in range(count):
    with tracing.span("write", None, {"i": i, "blob": blob}):
        pass
    if i % 50 == 0:
        tracing.force_flush()      # many small batches: many chances to interleave
tracing.shutdown_tracing()
"""


def test_two_processes_append_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, "400"], cwd=REPO,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
             for name in ("svc-a", "svc-b")]
    deadline = time.monotonic() + 30
    while not all(Path(f"{path}.{n}.ready").exists() for n in ("svc-a", "svc-b")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "writers did not start"
        time.sleep(0.01)
    Path(f"{path}.go").touch()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    spans = [json.loads(line) for line in lines[:-1]]  # raises if any line is torn or interleaved
    assert Counter(s["service"] for s in spans) == {"svc-a": 400, "svc-b": 400}
    for s in spans:
        assert s["attributes"]["blob"] == s["service"] * (16384 // len(s["service"]))
    for name in ("svc-a", "svc-b"):
        assert sorted(s["attributes"]["i"] for s in spans if s["service"] == name) == list(range(400))
    assert len({s["pid"] for s in spans}) == 2


def test_reader_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    good = {"trace_id": "1" * 32, "span_id": "2" * 16, "name": "x"}
    path.write_text(json.dumps(good) + "\n\n" + '{"trace_id": "1' + "\n")
    spans, bad = read_spans(path)
    assert spans == [good] and bad == 1
