"""The int8 group-32 linear in Triton (CUDA), beside its torch reference
(pdcluster/kernels/int8_linear.py ``int8_linear_ref``, same signature):
weight only, int8 codes [N, K] with fp16 (d, m) per (row, 32 k).

One program per (BM rows, BN columns) tile walks the K / 32 groups in order:
x's group [BM, 32] in fp32, the codes' [32, BN] widened to fp32 (exact),
``tl.dot`` gives each group's sums, then acc += dot * d + sum(x's group) * m
(the reference's formula, groups in k order, so a row's result does not
depend on the rows beside it); + bias, rounded once to the output dtype.
Launch grid (cdiv(M, BM), cdiv(N, BN)).  fp32 ``tl.dot`` may run as TF32 on
the GPU (``allow_tf32=False`` asks for full fp32)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.kernels.triton_common import check_device

GROUP = 32


@triton.jit
def _int8_g32_linear_kernel(
    x_ptr, q_ptr, s_ptr, bias_ptr, y_ptr, M, N, K,
    stride_x, stride_q, stride_y,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, G)
    groups = K // G
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, groups):
        kk = g * G + ks
        a = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=rows[:, None] < M, other=0.0).to(tl.float32)
        b = tl.load(q_ptr + cols[None, :] * stride_q + kk[:, None], mask=cols[None, :] < N, other=0).to(tl.float32)
        dot = tl.dot(a, b, allow_tf32=False)
        d = tl.load(s_ptr + (cols * groups + g) * 2, mask=cols < N, other=0.0).to(tl.float32)
        m = tl.load(s_ptr + (cols * groups + g) * 2 + 1, mask=cols < N, other=0.0).to(tl.float32)
        acc += dot * d[None, :] + tl.sum(a, axis=1)[:, None] * m[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def int8_linear_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                       block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """``int8_linear_ref`` on a CUDA device (or on the CPU under ``TRITON_INTERPRET=1``)."""
    check_device(x, codes, scales)
    n, k = codes.shape
    if codes.dtype != torch.int8 or codes.dim() != 2 or k != x.shape[-1] or k % GROUP:
        raise ValueError(f"codes must be int8 [N, {x.shape[-1]}] with K % 32 == 0, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if tuple(scales.shape) != (n, k // GROUP, 2):
        raise ValueError(f"scales must be [{n}, {k // GROUP}, 2] (d, m), got {tuple(scales.shape)}")
    x2 = x.reshape(-1, k).contiguous()
    codes, scales = codes.contiguous(), scales.float().contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_g32_linear_kernel[grid](x2, codes, scales, bias if bias is not None else scales, y, m, n, k,
                                  x2.stride(0), codes.stride(0), y.stride(0),
                                  HAS_BIAS=bias is not None, BM=block_m, BN=block_n, G=GROUP)
    return y.view(*x.shape[:-1], n)
