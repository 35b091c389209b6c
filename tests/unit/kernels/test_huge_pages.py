"""The weights a decode step streams are copied whole into one mapping advised for
transparent huge pages (pdcluster/kernels/huge_pages.py), and the model's
outputs do not change when they move there."""

import gc
import mmap
from pathlib import Path

import pytest
import torch

from pdcluster.kernels import cpu_native
from pdcluster.kernels.huge_pages import HUGE_PAGE_BYTES, TENSOR_ALIGN_BYTES, on_huge_pages
from tests.unit.kernels.test_fused_layers import mixed_batch, tiny_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mixed_tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(33, 7, generator=gen).to(torch.bfloat16),
            torch.randint(-128, 127, (5, 3, 2), dtype=torch.int8, generator=gen),
            torch.randn(1000, generator=gen),
            torch.randn(4, 64, generator=gen).to(torch.float16).t()]  # not contiguous


def _mapping(address: int) -> tuple[int, int, list[str]]:
    """(start, end, VmFlags) of the mapping in /proc/self/smaps that holds ``address``."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = (lo, hi) if lo <= address < hi else None
        elif found and head == "VmFlags:":
            return (*found, line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_equal_the_originals_and_start_aligned():
    originals = _mixed_tensors()
    copies = on_huge_pages(originals)
    assert len(copies) == len(originals)
    for t, c in zip(originals, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t) and c.data_ptr() != t.data_ptr()
    assert copies[0].data_ptr() % HUGE_PAGE_BYTES == 0
    assert all(c.data_ptr() % TENSOR_ALIGN_BYTES == 0 for c in copies)
    ends = [(c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies]
    assert all(ends[i][1] <= ends[i + 1][0] for i in range(len(ends) - 1)), "copies overlap"


def test_copies_outlive_every_other_reference_and_stay_writable():
    copies = on_huge_pages(_mixed_tensors())
    gc.collect()
    expected = _mixed_tensors()
    assert all(torch.equal(c, t) for c, t in zip(copies, expected))
    copies[2].fill_(3.0)  # weights are read-only in use, but the mapping is private, writable memory
    assert torch.equal(copies[2], torch.full((1000,), 3.0))
    assert torch.equal(copies[1], expected[1])


def test_empty_and_non_cpu_inputs():
    assert on_huge_pages([]) == []
    with pytest.raises(ValueError, match="CPU tensors"):
        on_huge_pages([torch.zeros(2, device="meta")])


@pytest.mark.skipif(not THP.exists() or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="this kernel has no transparent huge pages")
def test_the_mapping_is_advised_for_huge_pages():
    copies = on_huge_pages([torch.ones(3 * HUGE_PAGE_BYTES // 2, dtype=torch.bfloat16)])
    assert "hg" in _mapping(copies[0].data_ptr())[2]  # MADV_HUGEPAGE's flag; whether 2 MiB pages came is the kernel's


@pytest.mark.parametrize("tied", [True, False])
def test_pack_weights_moves_every_projection_and_the_head_once(tied):
    model = tiny_model(bias=False, tied=tied, pack=False)
    embedding = model.embed_tokens.weight
    projections = [p for layer in model.layers for p in layer.projections()]
    if not cpu_native.available():
        pytest.skip("needs the native CPU kernels: packing is a no-op without them")
    model.pack_weights()
    assert model.weights_on_huge_pages
    moved = [p.weight for p in projections] + [model.lm_head_weight]
    first = min(t.data_ptr() for t in moved)
    lo, hi, flags = _mapping(first)
    assert first % HUGE_PAGE_BYTES == 0
    assert all(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for t in moved)
    if THP.exists():
        assert "hg" in flags
    assert model.embed_tokens.weight is embedding  # the rows the embedding reads stay where they were
    before = [t.data_ptr() for t in moved]
    model.pack_weights()  # idempotent: nothing moves twice
    assert [p.weight.data_ptr() for p in projections] + [model.lm_head_weight.data_ptr()] == before


def test_outputs_do_not_change_when_the_weights_move():
    if not cpu_native.available():
        pytest.skip("needs the native CPU kernels: packing is a no-op without them")
    logits, pools = [], []
    for move in (False, True):
        model = tiny_model(bias=False, pack=False)
        model.weights_on_huge_pages = not move  # True: already "moved", so pack_weights leaves them
        model.pack_weights()
        pool = torch.zeros(10, 3, 2, 16, 2, 32, dtype=torch.bfloat16)
        logits.append(model(mixed_batch(), pool))
        pools.append(pool)
    assert torch.equal(logits[0], logits[1]) and torch.equal(pools[0], pools[1])
    assert torch.isfinite(logits[1]).all()
