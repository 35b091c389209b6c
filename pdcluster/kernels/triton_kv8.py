"""The 8-bit KV row (:mod:`pdcluster.kernels.kv_quant`) in Triton: encode a tile of
rows for the writer, decode a tile of rows for the attention kernels.

The kernels see an 8-bit pool as raw bytes (a ``uint8`` view), one row::

    | code[0] ... code[head_dim-1] | scale lo | scale hi |     code: int8 or e4m3 bits, scale: bf16 bits

Every rounding here is done on bit patterns with integer arithmetic, never
by a float conversion: the CPU interpreter truncates fp32 -> bf16 where a
GPU rounds to nearest, and the fp8 conversions differ between backends, so
only integer arithmetic writes the same bytes as torch everywhere.  Divisions
are ``div_rn`` (IEEE, as torch divides), not the GPU's approximate ``/``.
NaN and inf inputs are not handled (torch's bytes for them are not matched).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_bits(x):
    """fp32 -> its bf16 bit pattern (in a uint32), rounded to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@triton.jit
def round_half_even(y):
    """fp32 (|y| < 2**23) -> int32, ties to even, as ``torch.round``."""
    t = y.to(tl.int32)  # toward zero
    frac = tl.abs(y - t.to(tl.float32))  # exact below 2**23
    up = (frac > 0.5) | ((frac == 0.5) & ((t & 1) != 0))
    return tl.where(up, tl.where(y > 0, t + 1, t - 1), t)


@triton.jit
def e4m3_bits(y):
    """fp32 (|y| <= 448) -> its float8_e4m3fn code (in a uint32), rounded to nearest even.

    Normal codes (|y| >= 2**-6) keep 3 of the 23 mantissa bits; subnormal
    ones count units of 2**-9, rounded from the 24-bit significand."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)  # rebias 127 -> 7
    # subnormal: sig * 2**(e - 150) in units of 2**-9 is sig >> (141 - e); past 25 it rounds to 0
    shift = tl.minimum(tl.maximum(141 - (mag >> 23).to(tl.int32), 1), 25).to(tl.uint32)
    sig = (mag & 0x7FFFFF) | 0x800000
    one = tl.full(sig.shape, 1, tl.uint32)
    kept = sig >> shift
    rest = sig & ((one << shift) - 1)
    half = one << (shift - 1)
    sub = kept + ((rest > half) | ((rest == half) & ((kept & 1) != 0))).to(tl.uint32)
    return tl.where(mag < (121 << 23), sub, normal) | sign


@triton.jit
def encode_rows(x, FP8: tl.constexpr):
    """``x`` [R, BLOCK_D] fp32 (columns past head_dim zero) -> (codes [R,
    BLOCK_D] uint8, scales [R] bf16 bits in a uint32), as ``quantize_rows``:
    scale = bf16(amax / QMAX), code = round(x / scale) (0 where scale is 0)."""
    if FP8:
        qmax = 448.0
    else:
        qmax = 127.0
    amax = tl.max(tl.abs(x), axis=1)
    scale_bits = bf16_bits(tl.div_rn(amax, tl.full(amax.shape, qmax, tl.float32)))
    scale = (scale_bits << 16).to(tl.float32, bitcast=True)
    positive = scale > 0.0
    divisor = tl.broadcast_to(tl.where(positive, scale, 1.0)[:, None], x.shape)
    y = tl.where(positive[:, None], tl.div_rn(x, divisor), 0.0)
    if FP8:
        codes = e4m3_bits(tl.minimum(tl.maximum(y, -qmax), qmax))
    else:
        codes = tl.minimum(tl.maximum(round_half_even(y), -127), 127).to(tl.uint32, bitcast=True)
    return (codes & 0xFF).to(tl.uint8), scale_bits


@triton.jit
def store_rows(row_ptrs, codes, scale_bits, row_mask, offs_d, HEAD_DIM: tl.constexpr):
    """Writes encoded rows at ``row_ptrs`` [R] (uint8 pointers to each row's first byte)."""
    tl.store(row_ptrs[:, None] + offs_d[None, :], codes, mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM))
    tl.store(row_ptrs + HEAD_DIM, (scale_bits & 0xFF).to(tl.uint8), mask=row_mask)
    tl.store(row_ptrs + HEAD_DIM + 1, (scale_bits >> 8).to(tl.uint8), mask=row_mask)


@triton.jit
def e4m3_value(code):
    """A float8_e4m3fn code (uint32, 0..255) -> its fp32 value."""
    exp = (code >> 3) & 0xF
    man = code & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2**-9
    return tl.where(code >= 128, -mag, mag)


@triton.jit
def load_rows(row_ptrs, row_mask, offs_d, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """[R, BLOCK_D] fp32 values ``code * scale`` of the rows at ``row_ptrs``
    [R] (uint8 pointers); masked rows and columns past head_dim read 0."""
    d_mask = offs_d < HEAD_DIM
    raw = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0)
    lo = tl.load(row_ptrs + HEAD_DIM, mask=row_mask, other=0).to(tl.uint32)
    hi = tl.load(row_ptrs + HEAD_DIM + 1, mask=row_mask, other=0).to(tl.uint32)
    scale = (((hi << 8) | lo) << 16).to(tl.float32, bitcast=True)
    if FP8:
        values = e4m3_value(raw.to(tl.uint32))
    else:
        values = raw.to(tl.int8, bitcast=True).to(tl.float32)
    return values * scale[:, None]
