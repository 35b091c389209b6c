"""Decode attention: one query token per sequence over its paged KV.

CPU path: K and V of this layer gathered from the sequences' blocks (one
copy each, already in [B, tokens, kv_heads, d] order), then per KV head two
batched matmuls over the query heads that share it (GQA without repeating
K/V).  Scores, softmax and the weighted sum of V in fp32 whatever the KV dtype; an 8-bit pool
(:mod:`pdcluster.kernels.kv_quant`) is dequantized to fp32 as it is gathered."""

from __future__ import annotations

import torch

from pdcluster.kernels.kv_quant import dequantize_rows, is_quantized, pool_head_dim


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q``: [B, heads, head_dim]; ``block_tables``: [B, max_blocks] int32
    (entries past a sequence's last block must be valid block ids, e.g. 0;
    they are masked out); ``context_lens``: [B] int32, counting the current
    token, whose K/V is already in the pool.  Returns [B, heads, head_dim] in
    ``q``'s dtype.  Any heads/kv_heads ratio."""
    batch, heads, head_dim = q.shape
    block_size, kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    assert pool_head_dim(kv_pool) == head_dim, "q and the KV pool disagree on head_dim"
    group = heads // kv_heads
    n = block_tables.shape[1] * block_size
    idx = block_tables.long()
    k = kv_pool[:, layer, 0][idx].view(batch, n, kv_heads, -1)
    v = kv_pool[:, layer, 1][idx].view(batch, n, kv_heads, -1)
    if is_quantized(kv_pool.dtype):
        k, v = dequantize_rows(k), dequantize_rows(v)
    pad = torch.arange(n, device=q.device)[None, None, :] >= context_lens.to(torch.int64)[:, None, None]
    qg = q.reshape(batch, kv_heads, group, head_dim).float()
    out = torch.empty(batch, kv_heads, group, head_dim, dtype=q.dtype, device=q.device)
    for h in range(kv_heads):
        scores = torch.bmm(qg[:, h], k[:, :, h, :].float().transpose(1, 2))  # [B, g, N]
        scores.mul_(scale).masked_fill_(pad, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:, h] = torch.bmm(probs, v[:, :, h, :].float()).to(q.dtype)  # fp32 probs: a bf16 pool under fp32 q
    return out.view(batch, heads, head_dim)
