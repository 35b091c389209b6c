"""RMSNorm and fused residual-add + RMSNorm (Llama convention: normalise in
fp32, cast back, then scale by the weight)."""

from __future__ import annotations

import torch


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual <- x + residual`` (in place), returns
    ``(rmsnorm(residual) * weight, residual)``."""
    residual.add_(x)
    return rmsnorm_ref(residual, weight, eps), residual
