"""The W8A8 int8 linear in Triton (CUDA), beside its torch reference
(pdcluster/kernels/int8_linear.py ``int8_linear_ref``, same signature).

Activations are quantized per token by the reference's own torch ops (on
the device), then one program per (BM rows, BN columns) tile sums int8 x
int8 products in int32 with ``tl.dot`` (exact: the GPU's integer tensor
cores, or numpy under the interpreter) and applies the epilogue in the
reference's order: float(acc) * (row scale * column scale), then + bias,
rounded once to the output dtype.  Launch grid (cdiv(M, BM), cdiv(N, BN)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.kernels.int8_linear import quantize_tokens
from pdcluster.kernels.triton_common import check_device


@triton.jit
def _int8_linear_kernel(
    xq_ptr, xs_ptr, wq_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K,
    stride_x, stride_w, stride_y,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(0, K, BK):
        kk = k0 + ks
        a = tl.load(xq_ptr + rows[:, None] * stride_x + kk[None, :],
                    mask=(rows[:, None] < M) & (kk[None, :] < K), other=0)
        b = tl.load(wq_ptr + cols[None, :] * stride_w + kk[:, None],
                    mask=(cols[None, :] < N) & (kk[:, None] < K), other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    xs = tl.load(xs_ptr + rows, mask=rows < M, other=0.0)
    ws = tl.load(ws_ptr + cols, mask=cols < N, other=0.0)
    y = acc.to(tl.float32) * (xs[:, None] * ws[None, :])
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def int8_linear_triton(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                       block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """``int8_linear_ref`` on a CUDA device (or on the CPU under ``TRITON_INTERPRET=1``)."""
    check_device(x, wq, w_scale)
    if wq.dtype != torch.int8 or wq.dim() != 2 or wq.shape[1] != x.shape[-1]:
        raise ValueError(f"wq must be int8 [N, {x.shape[-1]}], got {wq.dtype} {tuple(wq.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_tokens(x2)
    wq = wq.contiguous()
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_linear_kernel[grid](xq, xs.contiguous(), wq, w_scale.float().contiguous(),
                              bias if bias is not None else w_scale, y, m, n, k,
                              xq.stride(0), wq.stride(0), y.stride(0),
                              HAS_BIAS=bias is not None, BM=block_m, BN=block_n, BK=block_k)
    return y.view(*x.shape[:-1], n)
