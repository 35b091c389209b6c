"""The greedy choice over fp32 logits (ops.argmax_rows; native: csrc/logits_argmax.h)
equals torch's argmax, ties included, and flags exactly the rows that hold a NaN
or an infinity."""

import pytest
import torch

from pdcluster.kernels import cpu_native, ops

NATIVE = pytest.mark.skipif(not cpu_native.available(), reason="needs AVX-512 BF16 or AVX2+FMA, and a C compiler")


def _torch(x: torch.Tensor) -> tuple[list[int], list[bool]]:
    return x.argmax(dim=-1).tolist(), torch.isfinite(x).all(dim=-1).tolist()


def _cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(rows, n, generator=gen) for rows, n in [(1, 49152), (16, 49152), (3, 1), (5, 7), (4, 8),
                                                                  (2, 9), (7, 1000), (64, 333)]]
    ties = torch.zeros(6, 100)
    ties[0, [3, 50]] = 2.0          # the first of two equal maxima
    ties[1, [9, 10, 99]] = 1.0
    ties[2, :] = -0.0
    ties[2, 40] = 0.0                # -0.0 == 0.0: the first index wins
    ties[3, [17, 91]] = torch.finfo(torch.float32).max
    ties[4, :] = float("-inf")      # every value -inf: finite no, argmax 0 as torch
    ties[5, 95:] = 5.0               # in the tail after the last whole vector of 8
    cases.append(ties)
    return cases


@NATIVE
@pytest.mark.parametrize("case", range(len(_cases())))
def test_finite_rows_match_torch_argmax_ties_included(case):
    x = _cases()[case]
    assert cpu_native.argmax_rows(x) == _torch(x)
    assert ops.argmax_rows(x) == _torch(x)


@NATIVE
def test_rows_with_a_nan_or_an_infinity_are_flagged_and_the_others_unchanged():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 1031, generator=gen)
    x[1, 5] = float("nan")
    x[2, 1030] = float("inf")       # in the scalar tail
    x[3, 0] = float("-inf")
    x[4, :] = float("nan")
    x[5, 600] = float("inf")
    x[5, 601] = float("-inf")
    x[6, 512] = float("nan")        # inside a vector, its lane later finite
    best, finite = cpu_native.argmax_rows(x)
    want_best, want_finite = _torch(x)
    assert finite == want_finite == [True, False, False, False, False, False, False, True, True]
    assert [b for b, ok in zip(best, finite) if ok] == [b for b, ok in zip(want_best, want_finite) if ok]


@NATIVE
def test_non_contiguous_and_empty_batches():
    x = torch.randn(40, 64)[::2, 3:]     # strided rows, an odd width
    assert cpu_native.argmax_rows(x) == _torch(x)
    assert ops.argmax_rows(torch.empty(0, 10)) == ([], [])


def test_the_torch_path_where_the_native_kernel_does_not_apply():
    x = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 0.0, 1.0]], dtype=torch.float64)  # not fp32
    best, finite = ops.argmax_rows(x)
    assert best[0] == 1 and finite == [True, False]
