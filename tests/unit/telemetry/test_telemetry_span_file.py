"""The span file stays bounded: it rotates at its cap, keeps N files,
is created 0600, and a writer whose file was rotated by another follows."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from pdcluster.observability import tracing
from pdcluster.observability.exporters import read_span_files
from pdcluster.observability.span_file import (SpanFile, SpanFileLimits, needs_rotation, rotated_path, rotation_moves,
                                     span_file_paths)


def line(i: int, width: int = 100) -> bytes:
    body = json.dumps({"trace_id": "1" * 32, "span_id": f"{i:016x}", "i": i})
    return (body + " " * (width - len(body) - 1) + "\n").encode()


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if p.name != path.name + ".lock")


def test_the_rotation_rule_and_its_renames():
    assert not needs_rotation(0, 5000, 1000)   # an empty file takes one line
    assert not needs_rotation(900, 100, 1000)
    assert needs_rotation(901, 100, 1000)
    p = Path("/r/spans.jsonl")
    assert rotation_moves(p, 2) == [(p.with_name("spans.jsonl.1"), p.with_name("spans.jsonl.2")),
                                    (p, p.with_name("spans.jsonl.1"))]
    assert rotation_moves(p, 0) == []
    assert rotated_path(p, 0) == p


def test_limits_refuse_bad_values_naming_the_variable():
    with pytest.raises(ValueError, match="PDCLUSTER_TRACE_FILE_MAX_BYTES"):
        SpanFileLimits.from_env({"PDCLUSTER_TRACE_FILE_MAX_BYTES": "lots"})
    with pytest.raises(ValueError, match="PDCLUSTER_TRACE_FILE_KEEP"):
        SpanFileLimits.from_env({"PDCLUSTER_TRACE_FILE_KEEP": "-1"})
    assert SpanFileLimits.from_env({"PDCLUSTER_TRACE_FILE_MAX_BYTES": "4096", "PDCLUSTER_TRACE_FILE_KEEP": "1"}) \
        == SpanFileLimits(4096, 1)


def test_writing_far_past_the_cap_keeps_n_files_each_under_the_cap(tmp_path: Path):
    path = tmp_path / "runs" / "spans.jsonl"
    f = SpanFile(path, SpanFileLimits(max_bytes=1000, keep=2))
    for i in range(500):               # 50 KB written, the cap is 1 KB x 3 files
        f.append([line(i)])
    f.close()
    assert [p.name for p in files_of(path)] == ["spans.jsonl", "spans.jsonl.1", "spans.jsonl.2"]
    for p in files_of(path):
        assert p.stat().st_size <= 1000
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    spans, bad = read_span_files(path, keep=2)
    assert bad == 0 and [s["i"] for s in spans] == list(range(470, 500))  # the newest 30, in order
    assert f.num_rotations == 49  # 50 files of 10 lines, 47 of them gone


def test_a_line_longer_than_the_cap_is_dropped_not_written(tmp_path: Path):
    path = tmp_path / "spans.jsonl"
    f = SpanFile(path, SpanFileLimits(max_bytes=150, keep=1))
    f.append([line(0), line(1, width=400), line(2)])
    f.close()
    assert f.num_dropped_lines == 1
    assert [s["i"] for s in read_span_files(path, keep=1)[0]] == [0, 2]


def test_keep_zero_drops_the_full_file(tmp_path: Path):
    path = tmp_path / "spans.jsonl"
    f = SpanFile(path, SpanFileLimits(max_bytes=250, keep=0))
    f.append([line(i) for i in range(5)])
    f.close()
    assert files_of(path) == [path] and path.stat().st_size == 100


def test_a_writer_whose_file_another_rotated_follows_at_its_next_batch(tmp_path: Path):
    """Two writers on one path, as two processes: each has its own descriptor."""
    path = tmp_path / "spans.jsonl"
    limits = SpanFileLimits(max_bytes=1000, keep=1)
    a, b = SpanFile(path, limits), SpanFile(path, limits)
    b.append([line(0)])
    a.append([line(i) for i in range(1, 12)])   # a fills the file and rotates it
    assert a.num_rotations == 1 and path.stat().st_size == 200
    b.append([line(12)])                         # b reopens the live file, not the rotated one
    a.close(), b.close()
    assert [s["i"] for s in read_span_files(path, keep=0)[0]] == [10, 11, 12]
    assert rotated_path(path, 1).stat().st_size == 1000


def test_an_existing_0644_file_is_tightened_to_0600(tmp_path: Path):
    path = tmp_path / "spans.jsonl"
    path.write_bytes(b"")
    path.chmod(0o644)
    f = SpanFile(path, SpanFileLimits())
    f.append([line(0)])
    f.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_tracer_writes_a_bounded_0600_file(span_file: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PDCLUSTER_TRACE_FILE_MAX_BYTES", "4000")
    monkeypatch.setenv("PDCLUSTER_TRACE_FILE_KEEP", "2")
    assert tracing.setup_tracing("pdcluster-test", jsonl_path=span_file)
    for i in range(200):
        with tracing.span(f"s{i}", None, {"i": i}):
            pass
    tracing.force_flush()
    paths = span_file_paths(span_file, 5)
    assert len(paths) == 3 and all(p.stat().st_size <= 4000 for p in paths)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in paths)
    spans, bad = read_span_files(span_file)
    assert bad == 0 and spans[-1]["name"] == "s199"
