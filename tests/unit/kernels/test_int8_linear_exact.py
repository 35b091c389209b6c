"""Every int8 linear that runs here equals, bit for bit (``torch.equal``), a torch mirror of its own
arithmetic (int8_mirror.py): the integer part exact, the fp32 steps in the kernel's order and roundings.

    build                   its group dot                                   the mirror
    avx2                    x to int16 per group, exact int32 sums          int64 einsum, rounded, * xs
    avx512_bf16 (emulated   VDPBF16PS: fp32 adds of exact products,         32 fp32 adds in that order
    here, emulated_bf16.c)  odd k of each pair first
    Triton (interpreted)    numpy's matmul and sum (orders of their own)    exact sums rounded once: equal
                                                                            where they are exact in any order
    torch fallback          int8_linear_ref itself (ops.linear)             itself

Then, in every native build, groups in k order through two FMAs (mirrored exactly by int8_mirror.fma32),
+ bias, fp32 out or bf16 rounded to nearest even.

The Triton kernel on general inputs is not bit-equal to any torch reference: under the interpreter its
tl.dot is numpy's matmul (the BLAS's own order, chosen per CPU) and its tl.sum numpy's sum, and on the GPU
the order of the dot is the compiler's and a mul + add may fuse.  Measured against the mirror (x randn,
8-bit codes; M, N, K = 17, 96, 576; 64, 128, 160; 3, 64, 64; 1, 32, 1536; three seeds each): 67-94% of
outputs differ, by up to 20480 fp32 ulps on outputs near zero (cancellation), and by at most 4.6e-7 of the
largest output; with numpy's matmul and sum on the kernel's own blocks in place of the exact sums, the
rest of the kernel matched bit for bit.  So the tolerance test in test_int8_linear.py stands for it.
"""

import numpy as np
import pytest
import torch

from pdcluster.kernels import int8_linear as il
from pdcluster.kernels import ops

import int8_mirror as mirror
from test_int8_linear import _q4_1_blocks, _q8_0_blocks

BF16 = torch.bfloat16
# (M, N, K): one row (the codes widened in registers), two, then blocks of rows through a widened tile, with
# remainders of both builds' row blocks (AVX2 5, AVX-512 6) and past M_BLOCK (256); K from one group up
SHAPES = [(1, 96, 96), (1, 32, 576), (2, 32, 32), (3, 64, 160), (17, 96, 96), (64, 128, 576), (260, 64, 64)]


def _weights(kind: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales): per group quantized (8-bit codes, -128..127), or a GGUF's Q4_1 (packed 4-bit) or Q8_0."""
    if kind == "int8":
        return il.quantize_groups(torch.randn(n, k))
    gen = np.random.default_rng(n * k)
    if kind == "Q4_1":
        return il.from_gguf_blocks(_q4_1_blocks(n, k, gen), 3)
    return il.from_gguf_blocks(_q8_0_blocks(n, k, gen), 8)


def _mirror_build(name: str) -> str:
    return "avx2" if name == "avx2" else "avx512_bf16"  # the emulated build runs avx512_bf16's code


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.float() - want.float()).abs()
    assert torch.equal(got, want), f"{int((diff > 0).sum())} of {got.numel()} differ, by up to {diff.max():.3g}"


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("kind", ["int8", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_equals_its_mirror(int8_build, m, n, k, kind, with_bias):
    """fp32 and bf16 out, 8-bit and (Q4_1) 4-bit packed codes, on one thread and on two."""
    name, lib = int8_build
    codes, scales = _weights(kind, n, k)
    packed = il.pack_int8_weight(codes, scales)
    assert il.packed_bits(packed) == (4 if kind == "Q4_1" else 8)
    x = torch.randn(m, k).to(BF16)
    bias = torch.randn(n).to(BF16) if with_bias else None
    want = mirror.int8_linear_mirror(x, codes, scales, bias, _mirror_build(name), fp32_out=True)
    for threads in (1, 2):
        _assert_bits_equal(il.linear_native(x, packed, bias, fp32_out=True, lib=lib, threads=threads), want)
    _assert_bits_equal(il.linear_native(x, packed, bias, lib=lib), want.to(BF16))


def test_native_equals_its_mirror_at_the_edges(int8_build):
    """Groups the int16 scaling finds hard: all zero (scale 0), one large value among tiny ones (those
    round to 0 or +-1), every value at the group's largest (the integer sums at their bound, codes at
    -128 / 127), and magnitudes from 2^-20 to 2^20 across groups; offsets large against the dots."""
    name, lib = int8_build
    n, k = 64, 192
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    codes[:, 96:128] = 127
    codes[::2, 96:128] = -128
    d = torch.exp2(torch.randint(-12, -4, (n, k // 32)).float())
    scales = torch.stack([d, torch.randn(n, k // 32) * 4], dim=-1).half()
    x = torch.randn(6, k)
    x[:, 0:32] = 0
    x[:, 32:64] *= 1e-4
    x[:, 40] = 300.0
    x[:, 96:128] = 1000.0
    x[1, 96:128:3] = -1000.0
    x[:, 128:160] *= 2.0 ** -20
    x[:, 160:192] *= 2.0 ** 20
    x = x.to(BF16)
    want = mirror.int8_linear_mirror(x, codes, scales, None, _mirror_build(name), fp32_out=True)
    _assert_bits_equal(il.linear_native(x, il.pack_int8_weight(codes, scales), fp32_out=True, lib=lib), want)


def test_fma32_rounds_once():
    """The mirror's FMA against exact rational arithmetic, on cases where mul then add rounds twice."""
    from fractions import Fraction
    a, b, c = torch.randn(3, 4000)
    got = mirror.fma32(a, b, c)
    assert not torch.equal(got, a * b + c)  # the cases are there
    for i in range(0, 4000, 7):
        exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        r = got[i]
        ulp = (torch.nextafter(r.abs(), torch.tensor(float("inf"))) - r.abs()).item()
        err = abs(Fraction(r.item()) - exact)
        assert err < Fraction(ulp) / 2 or (err == Fraction(ulp) / 2 and r.view(torch.int32) % 2 == 0), i


@pytest.mark.parametrize("m,n,k", [(1, 32, 32), (3, 64, 64), (17, 96, 160), (64, 128, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_equals_its_mirror_where_the_sums_are_exact(tk, m, n, k, with_bias):
    """x on a 2^-6 grid, so its group dots and sums are exact in any order: what remains, the fp32 scale,
    offset and accumulation steps of the kernel, agrees bit for bit under the interpreter."""
    codes, scales = _weights("int8", n, k)
    x = torch.randint(-127, 128, (m, k)).float() / 64
    bias = torch.randn(n) if with_bias else None
    got = tk.int8_linear.int8_linear_triton(x, codes, scales, bias)
    _assert_bits_equal(got, mirror.triton_mirror(x, codes, scales, bias))


def test_the_torch_fallback_is_the_reference():
    """Where neither a native build (x not bf16) nor Triton (not CUDA) takes it, ops.linear is
    int8_linear_ref itself, packed weight or not."""
    codes, scales = _weights("Q4_1", 64, 96)
    x = torch.randn(5, 96)
    want = il.int8_linear_ref(x, codes, scales)
    _assert_bits_equal(ops.linear(x, codes, None, w_scales=scales), want)
    _assert_bits_equal(ops.linear(x, il.pack_int8_weight(codes, scales), None), want)
