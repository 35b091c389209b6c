"""int8 linears (pdcluster/kernels/int8_linear.py, csrc/int8_linear.h): the packed
layout, the path rule and its C mirror, and that every native build that
runs here (AVX-512 VNNI, AVX2; AMX-int8 where the CPU has it) equals the
torch reference bit for bit, integer sums exactly; the Triton kernel under
the interpreter likewise."""

import ctypes
import shutil

import pytest
import torch

from pdcluster.kernels import cpu_native
from pdcluster.kernels import int8_linear as il

BF16 = torch.bfloat16
SHAPES = [(1, 960, 576), (3, 64, 40), (9, 3072, 576), (17, 576, 1536), (260, 96, 64)]  # (M, N, K)


def _runnable_builds():
    if not (shutil.which("cc") or shutil.which("gcc")):
        return []
    return [v for v in cpu_native.supported_variants()]


@pytest.fixture(scope="module", params=_runnable_builds(), ids=lambda v: v.name)
def build(request):
    """(variant name, that build's library), each loaded on its own."""
    lib = ctypes.CDLL(str(cpu_native.build(which=request.param)))
    fn = lib.pd_linear_int8
    fn.argtypes, fn.restype = cpu_native._SIGNATURES["pd_linear_int8"], None
    path = lib.pd_linear_int8_path
    path.argtypes, path.restype = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int], ctypes.c_int
    return request.param.name, lib


def test_quantize_weight_is_symmetric_per_output_channel():
    w = torch.randn(64, 40)
    w[3] = 0  # an all-zero row: scale 0, codes 0, no NaN
    q, scale = il.quantize_weight(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (64,)
    assert torch.equal(q.abs().amax(dim=1)[torch.arange(64) != 3], torch.full((63,), 127, dtype=torch.int8))
    assert scale[3] == 0 and not q[3].any()
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6


def test_pack_round_trips_and_holds_scales_and_row_sums():
    q, scale = il.quantize_weight(torch.randn(96, 64))
    packed = il.pack_int8_weight(q, scale)
    assert packed.shape == (3, 64 // 4 + 2, 32, 4) and il.is_packed_int8(packed)
    back_q, back_scale = il.unpack_int8_weight(packed)
    assert torch.equal(back_q, q) and torch.equal(back_scale, scale)
    wsum = packed[:, -1].contiguous().view(torch.int32).reshape(96)
    assert torch.equal(wsum, q.to(torch.int32).sum(dim=1, dtype=torch.int32))
    assert packed[0, 5, 7].tolist() == q[7, 20:24].tolist()  # tile 0, k quad 5, column 7
    with pytest.raises(ValueError, match="N % 32"):
        il.pack_int8_weight(q[:40], scale[:40])


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_equals_the_reference_bit_for_bit(build, m, n, k, with_bias):
    _, lib = build
    q, scale = il.quantize_weight(torch.randn(n, k))
    packed = il.pack_int8_weight(q, scale)
    x = torch.randn(m, k).to(BF16)
    bias = torch.randn(n).to(BF16) if with_bias else None
    assert torch.equal(il.linear_native(x, packed, bias, lib=lib), il.int8_linear_ref(x, q, scale, bias))
    got = il.linear_native(x, packed, bias, fp32_out=True, lib=lib)
    assert torch.equal(got, il.int8_linear_ref(x, q, scale, bias, out_dtype=torch.float32))


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_integer_sums_are_exact(build, m, n, k):
    """Integer x whose rows reach 127 and unit weight scales: every output is its int32 sum, unrounded."""
    _, lib = build
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    x = torch.randint(-127, 128, (m, k)).float()
    x[:, 0] = 127  # amax 127: activation scale 1, codes = x
    packed = il.pack_int8_weight(q, torch.ones(n))
    got = il.linear_native(x.to(BF16), packed, fp32_out=True, lib=lib)
    assert torch.equal(got, il.int8_accumulate(x.to(torch.int8), q).float())


def test_extreme_codes_do_not_saturate(build):
    """|q| = |w| = 127 everywhere: the AVX2 pair sums sit at their bound (2 x 127 x 127) and must not clip."""
    _, lib = build
    n, k = 32, 1536
    q = torch.full((n, k), 127, dtype=torch.int8)
    q[::2] = -127
    x = torch.full((2, k), 127.0)
    x[1, ::3] = -127.0
    got = il.linear_native(x.to(BF16), il.pack_int8_weight(q, torch.ones(n)), fp32_out=True, lib=lib)
    assert torch.equal(got, il.int8_accumulate(x.to(torch.int8), q).float())


def test_a_row_is_the_same_in_any_batch(build):
    _, lib = build
    q, scale = il.quantize_weight(torch.randn(960, 576))
    packed = il.pack_int8_weight(q, scale)
    x = torch.randn(37, 576).to(BF16)
    whole = il.linear_native(x, packed, lib=lib)
    for r in (0, 8, 36):
        assert torch.equal(il.linear_native(x[r:r + 1], packed, lib=lib), whole[r:r + 1])


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_weight_only_matches_its_reference(build, m, n, k):
    _, lib = build
    q, scale = il.quantize_weight(torch.randn(n, k))
    x = torch.randn(m, k).to(BF16)
    got = il.linear_native(x, il.pack_int8_weight(q, scale), mode="weight_only", fp32_out=True, lib=lib)
    want = il.weight_only_linear_ref(x, q, scale, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=1e-4 * k ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("m,n,k,variant,ready,mode,expected", [
    (1, 960, 576, "amx_bf16", True, "w8a8", "amx_int8"),
    (1024, 576, 1536, "amx_bf16", True, "w8a8", "amx_int8"),
    (4, 64, 40, "amx_bf16", True, "w8a8", "avx512_vnni"),   # K not a multiple of the tile depth (64)
    (4, 960, 576, "amx_bf16", False, "w8a8", "avx512_vnni"),  # Linux refused the tile state
    (4, 960, 576, "avx512_bf16", True, "w8a8", "avx512_vnni"),
    (4, 960, 576, "avx2", True, "w8a8", "avx2"),
    (4, 960, 576, "avx2", True, "weight_only", "weight_only"),
    (4, 960, 576, None, True, "w8a8", "torch"),
])
def test_path_is_a_pure_function_of_shape_build_and_mode(m, n, k, variant, ready, mode, expected):
    assert il.int8_linear_path(m, n, k, variant, ready, mode) == expected


@pytest.mark.skipif(not cpu_native.available(), reason="needs the native kernels")
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("mode", ["w8a8", "weight_only"])
def test_the_c_side_routes_as_the_python_mirror_says(m, n, k, mode):
    variant = cpu_native.loaded_variant()
    ready = variant == "amx_bf16" and cpu_native.amx_ready()
    assert il.native_path(m, n, k, mode) == il.int8_linear_path(m, n, k, variant, ready, mode)


@pytest.mark.parametrize("m,n,k", [(3, 64, 40), (17, 96, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_int8_linear_matches_reference(tk, m, n, k, with_bias):
    q, scale = il.quantize_weight(torch.randn(n, k))
    x = torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    got = tk.int8_linear.int8_linear_triton(x, q, scale, bias)
    assert torch.equal(got, il.int8_linear_ref(x, q, scale, bias))
