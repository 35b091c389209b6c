"""Linears over int8 weights in groups of 32 (``weight_dtype: int8``): the
scheme, the torch reference, the packed layout the native kernels read
(csrc/int8_linear.h), and the call into them.

    W[n, k] = d[n, g] * q[n, k] + m[n, g]      g = k // 32; q int8, d and m fp16 ("scales" [N, K/32, 2])
    y[r, n] = sum_g ( d[n, g] * (x[r, group g] . q[n, group g]) + m[n, g] * sum(x[r, group g]) ) + bias[n]

Weight only, in a GGUF's layout: a Q4_1 block (d, m fp16; 32 codes 0..15) and
a Q8_0 block (d fp16; 32 codes -127..127; m = 0) are one group each, exactly
(:func:`from_gguf_blocks`), so the default model's Q4_1 file runs as
shipped, nearer to it than its bf16 copy.  Other checkpoints quantize per
group asymmetrically (:func:`quantize_groups`, codes -128..127).  Packed
(:func:`pack_int8_weight`), codes that all fit a nibble (Q4_1's) take 4 bits
each, others 8; the products are the same either way.

The activations: bf16 on AVX-512 BF16 (VDPBF16PS against the codes widened
to bf16) and in the torch reference and Triton (fp32); the AVX2 build scales
each row's group of 32 to int16 (steps of 2^-15 of the group's largest
value, well under bf16's own rounding) for exact integer group sums
(csrc/int8_linear.h).  A row's output does not depend on the batch it comes
in nor on the threads (exact resume): each row sums its groups in k order
on every path.

Measured (``python -m bench.micro.weight_quant --kernels``: the 120
projections of SmolLM2-135M, 2 threads, on a 2-vCPU Intel Xeon with AVX-512F
and VNNI but no AVX-512 BF16, so the avx2 build; shared with another job's
test run, so noisy by tens of percent; ms and ratio to the bf16 packed
linear in the same run):

    build     M    bf16    int8, 8-bit codes   4-bit codes (Q4_1's)
    avx2      1   16.55    11.32 (0.68x)        7.00 (0.42x)
    avx2     16   71.87    50.30 (0.70x)       46.61 (0.65x)
    avx2    256  873.13   643.23 (0.74x)      657.79 (0.75x)

(Other runs of the same build the same afternoon: 4-bit 0.33x-0.49x at
M=1, 0.58x-0.70x at 16, 0.64x-0.76x at 256.)  The LM head (49152 x 576,
Q8_0's codes, 8 bits) at batch 1: bf16 3.56 ms, int8 1.59 ms (0.45x;
0.18x-0.58x in other runs), so the head runs in int8.
The AVX-512 BF16 micro-kernels (csrc/int8_linear_avx512.h) have not run on
BF16 hardware: the tests run them here with the BF16 instructions emulated
(tests/unit/kernels/emulated_bf16.c), for correctness only.  Every build that
runs equals, bit for bit, a torch mirror of its own arithmetic (the integer
sums exact, the fp32 steps in its order: tests/unit/kernels/int8_mirror.py).
"""

from __future__ import annotations

import numpy as np
import torch

from pdcluster.kernels import cpu_native

GROUP = 32  # k per group (G32_K in the C source)
TILE = 32  # output columns per packed tile

# The GGUF block types this scheme holds exactly (ggml type ids)
_Q4_1, _Q8_0 = 3, 8


# ---- the scheme ----------------------------------------------------------------

def from_gguf_blocks(raw: np.ndarray, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF tensor's raw blocks (uint8 [rows, bytes], as ``gguf.GGUFReader`` gives them) of type Q4_1 (3) or
    Q8_0 (8) -> (codes int8 [rows, K], scales fp16 [rows, K/32, 2]): every value exactly as the file's."""
    rows = raw.shape[0]
    if ggml_type == _Q4_1:
        blocks = raw.reshape(rows, -1, 20)
        dm = blocks[..., :4].copy().view(np.float16).reshape(rows, -1, 2)
        nib = blocks[..., 4:]
        codes = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.int8)  # elements 0..15, then 16..31
    elif ggml_type == _Q8_0:
        blocks = raw.reshape(rows, -1, 34)
        d = blocks[..., :2].copy().view(np.float16)
        dm = np.concatenate([d, np.zeros_like(d)], axis=-1)
        codes = blocks[..., 2:].copy().view(np.int8)
    else:
        raise ValueError(f"ggml type {ggml_type} is not Q4_1 (3) or Q8_0 (8): quantize its values instead")
    return (torch.from_numpy(codes.reshape(rows, -1).copy()),
            torch.from_numpy(np.ascontiguousarray(dm)).reshape(rows, -1, 2))


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight (K % 32 == 0) -> (codes int8 [N, K], scales fp16 [N, K/32, 2]): per group,
    m the midpoint of its range and d the range / 255, both rounded to fp16 before the codes are made."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int8 weights come in groups of {GROUP} along K; this weight is {n}x{k}: "
                         f"use weight_dtype: auto for this model")
    w = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = ((hi - lo) / 255).half()
    m = ((hi + lo) / 2).half()
    safe = torch.where(d > 0, d.float(), torch.ones_like(lo))
    q = torch.round((w - m.float()[..., None]) / safe[..., None]).clamp(-128, 127)
    q = torch.where((d > 0)[..., None], q, torch.zeros_like(q)).to(torch.int8)
    return q.view(n, k), torch.stack([d, m], dim=-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K]: d * q + m per group (exact in fp32 for GGUF's blocks: as gguf's own dequantize)."""
    n, k = codes.shape
    s = scales.float()
    return (codes.float().view(n, -1, GROUP) * s[..., :1] + s[..., 1:]).view(n, k)


def int8_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` [..., K] times int8 ``codes`` [N, K] with ``scales`` [N, K/32, 2] -> [..., N] in x's dtype (or
    out_dtype), the formula above in fp32: each group's dot product, then d and m applied."""
    n, k = codes.shape
    x2 = x.reshape(-1, k).float().view(-1, k // GROUP, GROUP)
    dots = torch.einsum("rgk,ngk->rng", x2, codes.float().view(n, -1, GROUP))
    s = scales.float()
    y = (dots * s[None, ..., 0] + x2.sum(-1)[:, None, :] * s[None, ..., 1]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], n)


# ---- the packed layout (csrc/int8_linear.h) ------------------------------------

def packable(codes: torch.Tensor) -> bool:
    return codes.dim() == 2 and codes.shape[0] % TILE == 0 and codes.shape[1] % GROUP == 0


def code_bits(codes: torch.Tensor) -> int:
    """4 when every code fits a nibble (0..15: a GGUF's Q4_1 tensor), else 8: the bits a packed code takes."""
    return 4 if codes.numel() and int(codes.min()) >= 0 and int(codes.max()) <= 15 else 8


def group_bytes(bits: int) -> int:
    """One group of one packed tile: its codes, then 32 d and 32 m in fp16 (g32_group_bytes in the C source)."""
    return 1024 * bits // 8 + 128


def pack_int8_weight(codes: torch.Tensor, scales: torch.Tensor, bits: int | None = None) -> torch.Tensor:
    """(int8 [N, K], fp16 [N, K/32, 2]) -> int8 [N / 32, K / 32, group_bytes(bits)]: tile j's group g is its
    codes as [16 k pairs][32 columns][2] (8 bits), or those 1024 codes two to a byte (4 bits: byte i of a k
    pair's 32 holds its codes i and 32 + i), then the 32 columns' d, then their m (fp16).  ``bits``: default
    :func:`code_bits`'s answer."""
    if not packable(codes):
        raise ValueError(f"int8 packing needs N % {TILE} == 0 and K % {GROUP} == 0, got {tuple(codes.shape)}")
    bits = bits or code_bits(codes)
    n, k = codes.shape
    tiles, groups = n // TILE, k // GROUP
    q = codes.view(tiles, TILE, groups, GROUP // 2, 2).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 16, 64)
    if bits == 4:
        if code_bits(codes) != 4:
            raise ValueError("4-bit packing needs every code in 0..15")
        q = (q[..., :32] | (q[..., 32:] << 4))
    s = scales.half().view(tiles, TILE, groups, 2).permute(0, 2, 3, 1).contiguous()  # [tiles, groups, (d, m), 32]
    return torch.cat([q.reshape(tiles, groups, -1), s.view(torch.int8).reshape(tiles, groups, 128)], dim=2).contiguous()


def packed_bits(packed: torch.Tensor) -> int:
    return 4 if packed.shape[-1] == group_bytes(4) else 8


def unpack_int8_weight(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (codes, scales) that :func:`pack_int8_weight` packed."""
    tiles, groups, size = packed.shape
    raw = packed[..., :size - 128].reshape(tiles, groups, 16, -1)
    if packed_bits(packed) == 4:
        raw = torch.cat([raw & 0x0F, (raw >> 4) & 0x0F], dim=-1)
    codes = raw.reshape(tiles, groups, GROUP // 2, TILE, 2).permute(0, 3, 1, 2, 4)
    s = packed[..., size - 128:].contiguous().view(torch.float16).view(tiles, groups, 2, TILE).permute(0, 3, 1, 2)
    return codes.reshape(tiles * TILE, groups * GROUP), s.reshape(tiles * TILE, groups, 2)


def is_packed_int8(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.int8 and weight.dim() == 3


def native_takes(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.is_cpu and cpu_native.available()


def linear_native(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  fp32_out: bool = False, lib=None, threads: int | None = None) -> torch.Tensor:
    """``x`` [..., K] bf16 on the CPU times a packed int8 weight; bf16 out (fp32 when ``fp32_out``).
    ``lib``: another loaded build of the kernels (tests run every variant); default the process's own."""
    tiles, groups, _ = packed.shape
    n, k = tiles * TILE, groups * GROUP
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32 if fp32_out else x.dtype)
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    p = cpu_native._p
    (lib or cpu_native.library()).pd_linear_int8(p(x2), p(packed), p(b), None if fp32_out else p(y),
                                                 p(y) if fp32_out else None, x2.shape[0], n, k,
                                                 packed_bits(packed), threads or cpu_native.num_threads())
    return y.view(*x.shape[:-1], n)
