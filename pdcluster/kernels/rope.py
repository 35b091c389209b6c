"""Rotary position embedding, the Llama/HF "rotate half" convention::

    x = [x1 | x2]   (two halves of head_dim)
    out = [x1*cos - x2*sin | x2*cos + x1*sin]
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    head_dim: int, max_positions: int, theta: float, inv_freq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 caches [max_positions, head_dim] (each half repeated, as HF)."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    t = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``: [T, heads, d], ``k``: [T, kv_heads, d], ``positions``: [T].
    Rotates q and k in place and returns them."""
    cos = cos_cache[positions].to(q.dtype)[:, None, :]
    sin = sin_cache[positions].to(q.dtype)[:, None, :]
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))
    return q, k
