"""Prefill attention: a chunk of new query tokens per sequence attends
causally to itself and to every earlier token already in paged KV.

One sequence's keys, with ``q_len`` new tokens at the end::

    |<------------- context_len ------------->|
    [ cached prefix / earlier chunks | new chunk ]
                                     ^ query i sees keys 0 .. context_len - q_len + i
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kv_quant import dequantize_rows, is_quantized


def prefill_attention_ref(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q``: [T, heads, head_dim], the sequences' new tokens back to back;
    ``query_start_loc``: [S+1] int32 offsets into ``q``; ``context_lens``: [S]
    int32 total tokens of each sequence including the new ones (whose K/V is
    already written); ``block_tables``: [S, max_blocks] int32.
    Returns [T, heads, head_dim]."""
    heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for i, ctx in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-ctx // block_size)
        kv = kv_pool[block_tables[i, :num_blocks].long(), layer]  # [nb, 2, bs, kvh, d]
        k = kv[:, 0].reshape(-1, kv_heads, kv.shape[-1])[:ctx]
        v = kv[:, 1].reshape(-1, kv_heads, kv.shape[-1])[:ctx]
        if is_quantized(kv.dtype):  # 8-bit rows, scales beside them: dequantize to q's dtype
            k, v = dequantize_rows(k, q.dtype), dequantize_rows(v, q.dtype)
        k, v = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
        qs = q[q_start:q_end].transpose(0, 1)  # [heads, q_len, d]
        if q_len == ctx:
            o = F.scaled_dot_product_attention(
                qs, k, v, is_causal=True, scale=scale, enable_gqa=heads != kv_heads)
        else:
            query_pos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= query_pos[:, None]
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
        out[q_start:q_end] = o.transpose(0, 1)
    return out
