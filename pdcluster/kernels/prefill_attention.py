"""Prefill attention: a chunk of new query tokens per sequence attends
causally to itself and to every earlier token already in paged KV.

One sequence's keys, with ``q_len`` new tokens at the end::

    |<------------- context_len ------------->|
    [ cached prefix / earlier chunks | new chunk ]
                                     ^ query i sees keys 0 .. context_len - q_len + i

Over an 8-bit pool (:mod:`pdcluster.kernels.kv_quant`) a prompt chunk reads only its
cached prefix from the pool; its own keys and values come from
:class:`ChunkKV`, as the model computed them, so quantization never reaches
the hidden states of the tokens being prefilled.
The pool's K rows are stored shifted by ``b`` (K smoothing); the fresh chunk
K is not, so the prefix keys get ``b`` added back as they are dequantized
and every key such a query sees is unshifted::

    key j <  ctx - q_len   dequantize(pool row j) + b      (prefix: rounded once, in fp32, to q's dtype)
    key j >= ctx - q_len   chunk.k[j - (ctx - q_len)]        (as computed: no rounding at all)

A sequence whose ``fresh`` flag is 0 (a draft's verification: it must
compute what plain decode computes, and decode reads every key from the
pool) reads all its keys from the pool, shifted, as before.  Plain pools are
always read as stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdcluster.kernels.kv_quant import dequantize_rows, is_quantized


@dataclass(frozen=True)
class ChunkKV:
    """The prefill part's own K/V as computed, for an 8-bit pool's prompt chunks.

    ``k``, ``v``: [T, kv_heads, head_dim], row t beside query row t (post-RoPE K,
    not shifted); ``fresh``: [S] int32, 1 where sequence s attends to its chunk
    through these (a prompt chunk), 0 where it reads the pool (a verification);
    ``k_shift``: None or [kv_heads, head_dim] fp32, the K smoothing shift the
    pool's K rows carry (added back to a fresh sequence's prefix keys)."""
    k: torch.Tensor
    v: torch.Tensor
    fresh: torch.Tensor
    k_shift: torch.Tensor | None = None

    def check(self, q: torch.Tensor, kv_pool: torch.Tensor, num_seqs: int) -> None:
        """Raises ``ValueError`` naming the fix when these do not fit ``q`` and the pool."""
        if not is_quantized(kv_pool.dtype):
            raise ValueError(f"ChunkKV applies to 8-bit pools only; a {kv_pool.dtype} pool is read as stored: "
                             f"pass None")
        want = (q.shape[0], kv_pool.shape[4], q.shape[2])
        if tuple(self.k.shape) != want or tuple(self.v.shape) != want:
            raise ValueError(f"ChunkKV k and v must be [T, kv_heads, head_dim] = {want} beside q, got "
                             f"{tuple(self.k.shape)} and {tuple(self.v.shape)}")
        if tuple(self.fresh.shape) != (num_seqs,):
            raise ValueError(f"ChunkKV fresh must hold one flag per sequence ({num_seqs}), got {tuple(self.fresh.shape)}")
        if self.k_shift is not None and (tuple(self.k_shift.shape) != want[1:] or self.k_shift.dtype != torch.float32):
            raise ValueError(f"ChunkKV k_shift must be float32 of shape {want[1:]}, got "
                             f"{self.k_shift.dtype} {tuple(self.k_shift.shape)}")


def _keys_values(kv: torch.Tensor, ctx: int, q: torch.Tensor, chunk: ChunkKV | None, fresh: bool,
                 q_start: int, q_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's [ctx, kv_heads, d] keys and values in q's dtype, from its
    blocks ``kv`` [nb, 2, bs, kvh, row] (and the chunk's own, when ``fresh``)."""
    k = kv[:, 0].reshape(-1, kv.shape[-2], kv.shape[-1])[:ctx]
    v = kv[:, 1].reshape(-1, kv.shape[-2], kv.shape[-1])[:ctx]
    if not is_quantized(kv.dtype):
        return k.to(q.dtype), v.to(q.dtype)
    if not fresh:  # 8-bit rows, scales beside them: dequantized, rounded once to q's dtype
        return dequantize_rows(k, q.dtype), dequantize_rows(v, q.dtype)
    prefix = ctx - (q_end - q_start)
    kp, vp = dequantize_rows(k[:prefix]), dequantize_rows(v[:prefix])
    if chunk.k_shift is not None:
        kp = kp + chunk.k_shift
    k = torch.cat([kp.to(q.dtype), chunk.k[q_start:q_end].to(q.dtype)])
    v = torch.cat([vp.to(q.dtype), chunk.v[q_start:q_end].to(q.dtype)])
    return k, v


def prefill_attention_ref(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    chunk: ChunkKV | None = None,
) -> torch.Tensor:
    """``q``: [T, heads, head_dim], the sequences' new tokens back to back;
    ``query_start_loc``: [S+1] int32 offsets into ``q``; ``context_lens``: [S]
    int32 total tokens of each sequence including the new ones (whose K/V is
    already written); ``block_tables``: [S, max_blocks] int32; ``chunk``:
    None, or the new tokens' own K/V (8-bit pools only; module docstring).
    Returns [T, heads, head_dim]."""
    heads = q.shape[1]
    block_size, kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    if chunk is not None:
        chunk.check(q, kv_pool, context_lens.shape[0])
    fresh = [False] * context_lens.shape[0] if chunk is None else [bool(f) for f in chunk.fresh.tolist()]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for i, ctx in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-ctx // block_size)
        kv = kv_pool[block_tables[i, :num_blocks].long(), layer]  # [nb, 2, bs, kvh, row]
        k, v = _keys_values(kv, ctx, q, chunk, fresh[i], q_start, q_end)
        k, v = k.transpose(0, 1), v.transpose(0, 1)
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
