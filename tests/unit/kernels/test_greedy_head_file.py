"""The greedy head's screen kept in a file (kernels/greedy_head_file.py): read back it is the screen
built from the head, byte for byte; a file for another head is never used; a damaged or short file
is built again and rewritten; a directory that cannot be written costs only the reuse."""

import logging

import pytest
import torch

from pdcluster.kernels import greedy_head, greedy_head_file


def _head(seed: int, v: int = 96, k: int = 64) -> torch.Tensor:
    return (torch.randn(v, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)


class _Builds:
    """Counts the screens built from scratch (``greedy_head.screen_bytes``)."""

    def __init__(self, monkeypatch) -> None:
        self.count, real = 0, greedy_head.screen_bytes

        def counted(weight):
            self.count += 1
            return real(weight)

        monkeypatch.setattr(greedy_head, "screen_bytes", counted)


def test_a_kept_screen_is_read_back_equal_to_a_fresh_build(tmp_path, monkeypatch):
    w = _head(1)
    want = greedy_head.screen_bytes(w)
    builds = _Builds(monkeypatch)
    first = greedy_head.pack(w, keep_in=tmp_path)
    second = greedy_head.pack(w, keep_in=tmp_path)
    assert builds.count == 1  # the second start read the file
    assert torch.equal(first.packed, want) and torch.equal(second.packed, want)
    assert (second.vocab, second.hidden) == (96, 64)
    assert [p.name for p in tmp_path.iterdir()] == [greedy_head_file.file_for(tmp_path, w).name]


def test_another_head_never_reads_this_heads_file(tmp_path, monkeypatch):
    a, b = _head(1), _head(2)
    greedy_head.pack(a, keep_in=tmp_path)
    builds = _Builds(monkeypatch)
    got = greedy_head.pack(b, keep_in=tmp_path)
    assert builds.count == 1
    assert torch.equal(got.packed, greedy_head.screen_bytes(b))
    assert greedy_head_file.file_for(tmp_path, a) != greedy_head_file.file_for(tmp_path, b)


@pytest.mark.parametrize("damage", ["flipped_byte", "short", "long", "empty"])
def test_a_damaged_file_is_built_again_and_rewritten(tmp_path, monkeypatch, caplog, damage):
    w = _head(3)
    want = greedy_head.screen_bytes(w)
    greedy_head.pack(w, keep_in=tmp_path)
    path = greedy_head_file.file_for(tmp_path, w)
    data = bytearray(path.read_bytes())
    if damage == "flipped_byte":
        data[len(data) // 2] ^= 0x10
    elif damage == "short":
        data = data[:-1]
    elif damage == "long":
        data += b"\0"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    shape = greedy_head.screen_shape(96, 64)
    assert greedy_head_file.read(path, shape) is None
    builds = _Builds(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=greedy_head_file.__name__):
        got = greedy_head.pack(w, keep_in=tmp_path)
    assert builds.count == 1 and "damaged" in caplog.text
    assert torch.equal(got.packed, want)
    assert torch.equal(greedy_head_file.read(path, shape), want)  # rewritten whole


def test_a_directory_that_cannot_be_written_costs_only_the_reuse(tmp_path, caplog):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the directory should be")
    w = _head(4)
    with caplog.at_level(logging.WARNING, logger=greedy_head_file.__name__):
        got = greedy_head.pack(w, keep_in=blocked)
    assert torch.equal(got.packed, greedy_head.screen_bytes(w))
    assert "could not keep" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-dir"]  # no temporary file left behind
