"""Decode attention: one query token per sequence over its paged KV."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q``: [B, heads, head_dim]; ``block_tables``: [B, max_blocks] int32
    (entries past a sequence's last block are ignored); ``context_lens``: [B]
    int32, counting the current token, whose K/V is already in the pool.
    Returns [B, heads, head_dim] in ``q``'s dtype.  Any heads/kv_heads ratio."""
    batch, heads, head_dim = q.shape
    _, _, _, block_size, kv_heads, _ = kv_pool.shape
    max_blocks = block_tables.shape[1]
    kv = kv_pool[block_tables.long(), layer]  # [B, nb, 2, bs, kvh, d]
    kv = kv.transpose(1, 2).reshape(batch, 2, max_blocks * block_size, kv_heads, head_dim)
    k = kv[:, 0].transpose(1, 2)  # [B, kvh, N, d]
    v = kv[:, 1].transpose(1, 2)
    positions = torch.arange(max_blocks * block_size, device=q.device)
    mask = (positions[None, :] < context_lens[:, None].to(positions.dtype))[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out.squeeze(2)
