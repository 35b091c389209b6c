"""The converted-model cache's bookkeeping (pdcluster/services/model_cache.py): one
conversion however many processes ask, nothing half-written ever read, a
clear error where the cache cannot be written.  The conversion itself is
replaced by a stand-in here; tests/integration/engine/test_model_cache_real.py
checks the real one against transformers' own GGUF reader."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from pdcluster.services import model_cache


@pytest.fixture
def gguf(tmp_path) -> Path:
    p = tmp_path / "weights" / "tiny.gguf"
    p.parent.mkdir()
    p.write_bytes(b"not really a gguf")
    return p


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    r = tmp_path / "cache"
    monkeypatch.setenv(model_cache.CACHE_ENV, str(r))
    return r


def _slow_convert(log: Path):
    def convert(gguf_path: Path, out: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        (out / model_cache.CONFIG_FILE).write_text("{}")
    return convert


def _ask(gguf: str, result: multiprocessing.Queue) -> None:
    result.put(str(model_cache.converted(Path(gguf))))


def test_concurrent_processes_convert_once_and_all_get_the_complete_directory(gguf, root, tmp_path, monkeypatch):
    log = tmp_path / "conversions.log"
    monkeypatch.setattr(model_cache, "_convert", _slow_convert(log))
    ctx = multiprocessing.get_context("fork")  # the children inherit the stand-in converter
    q = ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(str(gguf), q)) for _ in range(3)]
    for p in procs:
        p.start()
    dirs = {q.get(timeout=30) for _ in procs}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len(log.read_text().splitlines()) == 1
    (only,) = dirs
    assert Path(only) == root / model_cache.cache_key(gguf)
    assert (Path(only) / model_cache.CONFIG_FILE).read_text() == "{}"
    assert [p.name for p in root.iterdir() if ".tmp-" in p.name] == []


def test_a_failed_conversion_leaves_nothing_and_the_next_call_converts(gguf, root, tmp_path, monkeypatch):
    def broken(gguf_path: Path, out: Path) -> None:
        (out / model_cache.TENSORS_FILE).write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(model_cache, "_convert", broken)
    with pytest.raises(RuntimeError, match="killed"):
        model_cache.converted(gguf)
    assert not (root / model_cache.cache_key(gguf)).exists()
    assert [p.name for p in root.iterdir() if ".tmp-" in p.name] == []
    monkeypatch.setattr(model_cache, "_convert", _slow_convert(tmp_path / "log"))
    assert (model_cache.converted(gguf) / model_cache.CONFIG_FILE).is_file()


def test_a_stale_temporary_directory_is_removed_by_the_next_converter(gguf, root, tmp_path, monkeypatch):
    stale = root / f"{model_cache.cache_key(gguf)}.tmp-dead"
    stale.mkdir(parents=True)
    (stale / model_cache.TENSORS_FILE).write_bytes(b"half")
    monkeypatch.setattr(model_cache, "_convert", _slow_convert(tmp_path / "log"))
    model_cache.converted(gguf)
    assert not stale.exists()


def test_a_changed_file_gets_a_new_key(gguf):
    before = model_cache.cache_key(gguf)
    gguf.write_bytes(b"other weights, other size")
    assert model_cache.cache_key(gguf) != before
    assert model_cache.cache_key(gguf).startswith("tiny-")


def test_an_unwritable_cache_names_the_variable_to_set(gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(model_cache.CACHE_ENV, str(blocker / "cache"))
    with pytest.raises(model_cache.ModelCacheError, match=model_cache.CACHE_ENV):
        model_cache.converted(gguf)
