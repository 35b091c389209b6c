"""RMSNorm and fused residual-add + RMSNorm in Triton.

One program per row (token): the whole hidden vector is one ``BLOCK``
tile.  Rounding follows the torch reference step by step: the residual sum
is rounded to the residual's dtype before it is normalised, the normalised
row is rounded to x's dtype, and only then scaled by the weight (result in
torch's promoted dtype of weight and x).  Launch grid (rows,).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.kernels.triton_common import check_device, next_pow2


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, eps, hidden,
    stride_x, stride_res, stride_out,
    FUSED_ADD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if FUSED_ADD:
        res_ptrs = res_ptr + row * stride_res + offs
        r = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)
        norm_dtype = res_ptr.dtype.element_ty
    else:
        norm_dtype = x_ptr.dtype.element_ty
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    y = (x * rstd).to(norm_dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _residual_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] as a [rows, hidden] view: never a copy, it is written in place."""
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError as err:
        raise ValueError("residual must be viewable as [rows, hidden]") from err
    if rows.stride(-1) != 1:
        raise ValueError("residual needs unit stride on the hidden dim")
    return rows


def _input_rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    src = residual if residual is not None else x
    hidden = x.shape[-1]
    x2 = _input_rows(x)
    r2 = _residual_rows(residual) if residual is not None else x2
    out = torch.empty(src.shape, dtype=torch.promote_types(weight.dtype, src.dtype), device=x.device)
    o2 = out.view(-1, hidden)
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), o2, eps, hidden, x2.stride(0), r2.stride(0), o2.stride(0),
            FUSED_ADD=residual is not None, BLOCK=next_pow2(hidden),
        )
    return out


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as :func:`pdcluster.kernels.rmsnorm.rmsnorm_ref`."""
    check_device(x, weight)
    return _launch(x, None, weight, eps)


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`pdcluster.kernels.rmsnorm.fused_add_rmsnorm_ref`:
    ``residual += x`` in place, returns ``(rmsnorm(residual), residual)``."""
    check_device(x, residual, weight)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    return _launch(x, residual, weight, eps), residual
