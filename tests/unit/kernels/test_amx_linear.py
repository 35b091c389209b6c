"""The AMX build of the native kernels (csrc/amx_linear.h): which linears
take the tiles (a pure function of rows, shape, build and whether Linux
granted the tile state), that the C side decides the same way, and that the
tile products equal torch's bf16 linear and the exact product within bf16
rounding at the default model's shapes."""

import math

import pytest
import torch
import torch.nn.functional as F

import pdcluster.kernels.ops as ops
from pdcluster.kernels import cpu_native

BF16 = torch.bfloat16
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: (N, K)


@pytest.mark.parametrize("m,n,k,variant,ready,expected", [
    (1, 960, 576, "amx_bf16", True, "amx"),        # every M or none: a row's sum must not depend on its batch
    (2, 960, 576, "amx_bf16", True, "amx"),
    (1024, 3072, 576, "amx_bf16", True, "amx"),
    (16, 576, 1536, "amx_bf16", True, "amx"),
    (16, 64, 40, "amx_bf16", True, "dot"),         # K not a multiple of the tile depth (32)
    (16, 960, 576, "amx_bf16", False, "dot"),      # Linux refused the tile state
    (1024, 960, 576, "avx512_bf16", True, "dot"),  # machines without AMX: as before
    (1024, 960, 576, "avx2", True, "dot"),
    (1024, 960, 576, None, True, "torch"),
])
def test_linear_path_is_a_pure_function_of_rows_shape_and_build(m, n, k, variant, ready, expected):
    assert cpu_native.linear_path(m, n, k, variant, ready) == expected


amx_here = pytest.mark.skipif(not (cpu_native.available() and cpu_native.amx_ready()),
                              reason="needs a CPU with AMX (amx_bf16) and the tile state granted")


@amx_here
def test_the_c_side_routes_as_the_python_mirror_says():
    lib = cpu_native.library()
    for m in (1, 2, 7, 8, 16, 33, 1024):
        for n, k in [*SMOLLM2_SHAPES, (64, 40), (32, 1538)]:
            path = cpu_native.linear_path(m, n, k, "amx_bf16", True)
            assert bool(lib.pd_linear_uses_amx(m, n, k)) == (path == "amx")
            assert ops.linear_path(m, n, k) == path


@amx_here
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 33, 256, 1024])
@pytest.mark.parametrize("n,k", SMOLLM2_SHAPES)
def test_tile_linear_equals_torch_within_bf16_rounding(rows, n, k):
    gen = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    got = ops.linear(x, ops.pack_linear_weight(w), bias)
    exact = F.linear(x.double(), w.double(), bias.double())
    # fp32 accumulation, one rounding to bf16: within one bf16 ulp of the exact value
    assert torch.all((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3 * math.sqrt(k))
    ref = F.linear(x, w, bias)  # torch (oneDNN, its own tiles here) rounds the same way up to summation order
    assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2**-7


@pytest.mark.skipif(not cpu_native.available(), reason="needs the native CPU kernels")
@pytest.mark.parametrize("n,k", [(3072, 576), (576, 1536)])
def test_a_row_is_the_same_in_any_batch_and_on_any_threads(n, k, monkeypatch):
    """Exact resume: a row alone, or among 37, 300 or 1,100 rows (several row blocks, and the tile
    groups csrc/amx_linear.h sizes by rows and threads), on 1 or 2 threads, gives the same bits."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1100, k, generator=gen).to(BF16)
    packed = ops.pack_linear_weight((torch.randn(n, k, generator=gen) * k ** -0.5).to(BF16))
    bias = torch.randn(n, generator=gen).to(BF16)
    picked = (0, 17, 36, 299, 1099)
    monkeypatch.setattr(cpu_native, "_threads", 1)  # set_num_threads, undone after the test
    alone = {r: ops.linear(x[r:r + 1], packed, bias) for r in picked}
    for rows in (37, 300, 1100):
        for threads in (1, 2):
            monkeypatch.setattr(cpu_native, "_threads", threads)
            batch = ops.linear(x[:rows], packed, bias)
            for r in picked:
                if r < rows:
                    assert torch.equal(batch[r:r + 1], alone[r]), (rows, threads, r)
