"""int8 linears in groups of 32 (pdcluster/kernels/int8_linear.py, csrc/int8_linear.h): the scheme (GGUF's
Q4_1 and Q8_0 blocks exactly, other weights per group), the packed layout, and that every native build that
runs here (the int8_build fixture, conftest.py: on an AVX-512 CPU without AVX-512 BF16 also that build with
its three BF16 instructions emulated, emulated_bf16.c) is near the scheme's fp32 reference on odd shapes and
gives a row the same bits in any batch and on any number of threads; the Triton kernel under the interpreter
likewise.  Each kernel's own arithmetic, bit for bit: test_int8_linear_exact.py."""

import numpy as np
import pytest
import torch

from pdcluster.kernels import int8_linear as il

BF16 = torch.bfloat16
SHAPES = [(1, 960, 576), (2, 32, 32), (3, 64, 96), (5, 96, 64), (9, 3072, 576), (17, 576, 1536), (260, 96, 64)]


# ---- the scheme ----------------------------------------------------------------

def _q4_1_blocks(rows: int, k: int, gen: np.random.Generator) -> np.ndarray:
    """Random Q4_1 rows as a GGUF holds them: per block fp16 d, fp16 m, 16 bytes of nibbles."""
    g = k // 32
    dm = gen.normal(0, 0.01, (rows, g, 2)).astype(np.float16).view(np.uint8).reshape(rows, g, 4)
    qs = gen.integers(0, 256, (rows, g, 16), dtype=np.uint8)
    return np.concatenate([dm, qs], axis=-1).reshape(rows, g * 20)


def _q8_0_blocks(rows: int, k: int, gen: np.random.Generator) -> np.ndarray:
    g = k // 32
    d = gen.normal(0, 0.01, (rows, g, 1)).astype(np.float16).view(np.uint8).reshape(rows, g, 2)
    qs = gen.integers(-127, 128, (rows, g, 32), dtype=np.int8).view(np.uint8)
    return np.concatenate([d, qs], axis=-1).reshape(rows, g * 34)


@pytest.mark.parametrize("kind,make", [(3, _q4_1_blocks), (8, _q8_0_blocks)], ids=["Q4_1", "Q8_0"])
def test_gguf_blocks_arrive_exactly(kind, make):
    """The codes and scales dequantize to the gguf package's own fp32 values, bit for bit."""
    gguf = pytest.importorskip("gguf")
    raw = make(40, 96, np.random.default_rng(0))
    codes, scales = il.from_gguf_blocks(raw, kind)
    assert codes.shape == (40, 96) and scales.shape == (40, 3, 2) and scales.dtype == torch.float16
    want = np.asarray(gguf.dequantize(raw, gguf.GGMLQuantizationType(kind)), dtype=np.float32)
    assert torch.equal(il.dequantize(codes, scales), torch.from_numpy(want))
    lo, hi = (0, 15) if kind == 3 else (-127, 127)
    assert lo <= codes.min() and codes.max() <= hi
    if kind == 8:
        assert not scales[..., 1].any()  # Q8_0: no offset


def test_other_types_are_refused():
    with pytest.raises(ValueError, match="Q4_1"):
        il.from_gguf_blocks(np.zeros((2, 64), dtype=np.uint8), 2)


def test_quantize_groups_is_within_half_a_step():
    w = torch.randn(64, 96)
    w[3, 32:64] = 0.25  # a constant group: d 0, codes 0, m the value
    codes, scales = il.quantize_groups(w)
    assert codes.dtype == torch.int8 and scales.shape == (64, 3, 2) and scales.dtype == torch.float16
    assert scales[3, 1, 0] == 0 and scales[3, 1, 1] == 0.25 and not codes[3, 32:64].any()
    d = scales[..., 0].float().repeat_interleave(32, dim=1)
    err = (il.dequantize(codes, scales) - w).abs()
    assert (err <= d * 0.5 + 1e-3 * w.abs()).all()  # half a step, plus the fp16 rounding of m
    with pytest.raises(ValueError, match="groups of 32"):
        il.quantize_groups(torch.randn(8, 40))


def test_q4_1_codes_pack_four_bits_a_code():
    codes = torch.randint(0, 16, (64, 96), dtype=torch.int8)
    scales = il.quantize_groups(torch.randn(64, 96))[1]
    packed = il.pack_int8_weight(codes, scales)
    assert il.code_bits(codes) == 4 and packed.shape == (2, 3, il.group_bytes(4)) and il.packed_bits(packed) == 4
    back_codes, back_scales = il.unpack_int8_weight(packed)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)
    assert il.packed_bits(il.pack_int8_weight(codes, scales, bits=8)) == 8
    with pytest.raises(ValueError, match="0..15"):
        il.pack_int8_weight(codes - 1, scales, bits=4)


def test_pack_round_trips():
    codes, scales = il.quantize_groups(torch.randn(96, 64))
    packed = il.pack_int8_weight(codes, scales)
    assert packed.shape == (3, 2, il.group_bytes(8)) and il.is_packed_int8(packed)
    back_codes, back_scales = il.unpack_int8_weight(packed)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)
    # tile 1, group 1, k pair 5, column 7: codes[32 + 7, 32 + 10 : 32 + 12]
    assert packed[1, 1, 5 * 64 + 7 * 2: 5 * 64 + 7 * 2 + 2].tolist() == codes[39, 42:44].tolist()
    assert packed[1, 1, 1024:1088].view(torch.float16)[7] == scales[39, 1, 0]  # its d
    with pytest.raises(ValueError, match="N % 32"):
        il.pack_int8_weight(codes[:40], scales[:40])


def test_reference_is_the_dequantized_product():
    codes, scales = il.quantize_groups(torch.randn(64, 96))
    x = torch.randn(5, 96)
    want = x.double() @ il.dequantize(codes, scales).double().T
    torch.testing.assert_close(il.int8_linear_ref(x, codes, scales).double(), want, rtol=1e-5, atol=1e-5)


# ---- the native kernels (every build that runs here) --------------------------------

def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 outputs within 1e-4 of the largest (bf16 inputs; AVX2 rounds x to int16 per group: 2^-15 steps)."""
    err = (got - want).abs().max() / want.abs().max()
    assert err < 1e-4, err


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_matches_the_reference(int8_build, m, n, k, with_bias):
    _, lib = int8_build
    codes, scales = il.quantize_groups(torch.randn(n, k))
    packed = il.pack_int8_weight(codes, scales)
    x = torch.randn(m, k).to(BF16)
    bias = torch.randn(n).to(BF16) if with_bias else None
    want = il.int8_linear_ref(x, codes, scales, bias, out_dtype=torch.float32)
    _close(il.linear_native(x, packed, bias, fp32_out=True, lib=lib), want)
    y = il.linear_native(x, packed, bias, lib=lib)
    assert y.dtype == BF16 and torch.equal(y, il.linear_native(x, packed, bias, fp32_out=True, lib=lib).to(BF16))


@pytest.mark.parametrize("m", [1, 2, 4, 40])
def test_native_takes_gguf_codes(int8_build, m):
    """Q4_1 codes (0..15, an offset m; packed 4 bits a code, bit for bit the 8-bit packing's result) and Q8_0
    codes (-127..127, no offset) as the file holds them."""
    _, lib = int8_build
    gen = np.random.default_rng(1)
    x = torch.randn(m, 576).to(BF16)
    for kind, make in ((3, _q4_1_blocks), (8, _q8_0_blocks)):
        codes, scales = il.from_gguf_blocks(make(64, 576, gen), kind)
        want = il.int8_linear_ref(x, codes, scales, out_dtype=torch.float32)
        packed = il.pack_int8_weight(codes, scales)
        assert il.packed_bits(packed) == (4 if kind == 3 else 8)
        got = il.linear_native(x, packed, fp32_out=True, lib=lib)
        _close(got, want)
        assert torch.equal(got, il.linear_native(x, il.pack_int8_weight(codes, scales, bits=8), fp32_out=True, lib=lib))


def test_extreme_codes_and_activations_do_not_overflow(int8_build):
    """Codes at -128 / 127 and every x at the group's largest value: the integer sums at their bound."""
    _, lib = int8_build
    n, k = 32, 1536
    codes = torch.full((n, k), 127, dtype=torch.int8)
    codes[::2] = -128
    scales = torch.stack([torch.full((n, k // 32), 0.01), torch.zeros(n, k // 32)], dim=-1).half()
    x = torch.full((3, k), 1000.0)
    x[1, ::3] = -1000.0
    x = x.to(BF16)
    want = il.int8_linear_ref(x, codes, scales, out_dtype=torch.float32)
    _close(il.linear_native(x, il.pack_int8_weight(codes, scales), fp32_out=True, lib=lib), want)


@pytest.mark.parametrize("n,k,bits", [(960, 576, 8), (96, 1536, 8), (960, 576, 4)])
def test_a_row_is_the_same_in_any_batch_and_on_any_threads(int8_build, n, k, bits):
    """Exact resume: a row alone, or among 3, 16 or 257 rows, on 1 or 2 threads, gives the same bits."""
    _, lib = int8_build
    codes, scales = il.quantize_groups(torch.randn(n, k))
    if bits == 4:
        codes = codes.abs().clamp(max=15)
    packed = il.pack_int8_weight(codes, scales)
    bias = torch.randn(n).to(BF16)
    x = torch.randn(257, k).to(BF16)
    alone = [il.linear_native(x[r:r + 1], packed, bias, fp32_out=True, lib=lib, threads=1) for r in (0, 2, 15, 256)]
    for rows in (3, 16, 257):
        for threads in (1, 2):
            batch = il.linear_native(x[:rows], packed, bias, fp32_out=True, lib=lib, threads=threads)
            for r, want in zip((0, 2, 15, 256), alone):
                if r < rows:
                    assert torch.equal(batch[r:r + 1], want), (rows, threads, r)


@pytest.mark.parametrize("m,n,k", [(3, 64, 64), (17, 96, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_int8_linear_matches_the_reference(tk, m, n, k, with_bias):
    codes, scales = il.quantize_groups(torch.randn(n, k))
    x = torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    got = tk.int8_linear.int8_linear_triton(x, codes, scales, bias)
    torch.testing.assert_close(got, il.int8_linear_ref(x, codes, scales, bias), rtol=1e-5, atol=1e-5)
    alone = tk.int8_linear.int8_linear_triton(x[1:2], codes, scales, bias)
    assert torch.equal(alone, got[1:2])  # a row's groups add up alike in any batch
