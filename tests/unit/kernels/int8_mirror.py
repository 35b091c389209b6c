"""The native int8 linears' arithmetic (pdcluster/kernels/csrc/int8_linear*.h), step for step in torch, so a
test can ask for the kernels' output bit for bit (test_int8_linear_exact.py).

Both builds share everything but the group dot product:

    xsum[r, g]   fp32 adds in g32_rows_prepare's fixed order (lanes j and j + 8, 16, 24 first; then j + 4;
                 then j + 2; then j + 1: drawn at :func:`group_sums`)
    dot_g        AVX2:          x's group scaled to int16 (inv = 32767 / amax, xs = amax / 32767, both fp32
                                divisions; q = round_half_even(x * inv)), the int16 x int8 products summed
                                exactly (int64 here; int32 there, no overflow: |sum| < 2^31), that sum
                                rounded to fp32, times xs (one fp32 rounding)
                 AVX-512 BF16:  VDPBF16PS per k pair, the odd k first (Intel's pseudocode), every product
                                exact in fp32 (bf16 x an integer of <= 8 bits), so: fp32 adds in the
                                order k = 1, 0, 3, 2, ..., 31, 30
    acc          per group in g order: acc = fma(dot_g, d, acc); acc = fma(m, xsum, acc)
    y            acc + bias (one fp32 add), then fp32 out or bf16 rounded to nearest even

The fused multiply-adds are computed exactly (:func:`fma32`), not as torch's multiply then add.
"""

from __future__ import annotations

import torch

GROUP = 32
INT16_TOP = 32767.0


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once, as the FMA instruction: the product is exact in fp64 (24 + 24 bits),
    the sum rounded to fp64 *to odd* (TwoSum gives its error; an inexact even result steps one ulp
    toward the exact sum), and fp64 rounded to odd then to fp32 is the exact sum rounded to fp32
    (53 >= 2 * 24 + 2)."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    back = s - p
    err = (p - (s - back)) + (cd - back)  # TwoSum: s + err == p + cd exactly
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def group_sums(x: torch.Tensor) -> torch.Tensor:
    """[M, G, 32] fp32 -> [M, G]: g32_rows_prepare's order.  Four 8-wide loads v0..v3 added lane by lane as
    (v0 + v1) + (v2 + v3), then g32_hsum8 across the 8 lanes:

        s[j] = (x[j] + x[8 + j]) + (x[16 + j] + x[24 + j])        j < 8
        sum  = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))
    """
    v = x.unflatten(-1, (4, 8))
    s = (v[..., 0, :] + v[..., 1, :]) + (v[..., 2, :] + v[..., 3, :])
    h = s[..., :4] + s[..., 4:]
    return (h[..., 0] + h[..., 2]) + (h[..., 1] + h[..., 3])


def int16_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AVX2: [M, G, 32] fp32 -> (codes int64 [M, G, 32] in -32767..32767, their scales xs fp32 [M, G])."""
    amax = x.abs().amax(dim=-1)
    top = torch.tensor(INT16_TOP)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    xq = torch.round(x * inv[..., None]).clamp(-INT16_TOP, INT16_TOP)
    return xq.long(), amax / top


def dots_avx2(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """[M, G, 32] fp32, codes [N, G, 32] -> [M, N, G] fp32: the exact integer sums, rounded, times xs."""
    xq, xs = int16_groups(x)
    exact = torch.einsum("rgk,ngk->rng", xq, codes.long())
    assert exact.abs().max() < 2 ** 31  # the kernel's int32 sums
    return exact.float() * xs[:, None, :]


def dots_bf16(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """[M, G, 32] fp32 (bf16 values), codes [N, G, 32] -> [M, N, G] fp32: VDPBF16PS's adds, odd k first."""
    w = codes.float()
    t = torch.zeros(x.shape[0], w.shape[0], x.shape[1])
    for pair in range(GROUP // 2):
        for k in (2 * pair + 1, 2 * pair):
            t = t + x[:, None, :, k] * w[None, :, :, k]  # the product exact: one rounding, as the FMA
    return t


def accumulate(dots: torch.Tensor, xsum: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[M, N, G] group dots, [M, G] group sums, [N, G, 2] fp16 (d, m) -> [M, N] fp32, groups in g order."""
    d, m = scales.float().unbind(-1)
    acc = torch.zeros(dots.shape[:2])
    for g in range(dots.shape[2]):
        acc = fma32(dots[..., g], d[None, :, g], acc)
        acc = fma32(m[None, :, g], xsum[:, None, g], acc)
    return acc


def int8_linear_mirror(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None, build: str = "avx2",
                       fp32_out: bool = False) -> torch.Tensor:
    """``pd_linear_int8`` of ``build`` ("avx2", or "avx512_bf16": that build's own arithmetic, as Intel
    documents VDPBF16PS) on bf16 x [M, K], codes int8 [N, K], scales fp16 [N, K / 32, 2], bias bf16 [N]."""
    n, k = codes.shape
    xg = x.reshape(-1, k).float().view(-1, k // GROUP, GROUP)
    qg = codes.view(n, k // GROUP, GROUP)
    dots = dots_avx2(xg, qg) if build == "avx2" else dots_bf16(xg, qg)
    y = accumulate(dots, group_sums(xg), scales)
    if bias is not None:
        y = y + bias.float()
    return y if fp32_out else y.to(torch.bfloat16)


def triton_mirror(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """triton_int8_linear.py's steps in fp32 (no fused multiply-adds: the interpreter runs each numpy op
    alone), each group's dot and sum of x rounded once from exact.  Bit for bit the interpreter's only
    where those sums are exact in fp32 in any order (its tl.dot is numpy's matmul, its tl.sum numpy's
    sum: orders of their own), as for x on a 2^-6 grid below 2: every partial sum a multiple of 2^-6
    under 2^13."""
    n, k = codes.shape
    xg = x.reshape(-1, k).float().view(-1, k // GROUP, GROUP)
    qg = codes.view(n, k // GROUP, GROUP).double()
    dots = torch.einsum("rgk,ngk->rng", xg.double(), qg).float()
    xsum = xg.double().sum(-1).float()
    d, m = scales.float().unbind(-1)
    acc = torch.zeros(dots.shape[:2])
    for g in range(dots.shape[2]):
        acc = acc + (dots[..., g] * d[None, :, g] + xsum[:, None, g] * m[None, :, g])
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)
