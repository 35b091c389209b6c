"""Paged decode attention in Triton: online softmax, GQA-grouped, split-K.

One program owns (sequence b, kv head g, split s): it loads the ``GROUP``
query heads that share kv head g as one [BLOCK_H, D] tile (so each K/V byte
is read once per kv head, not once per query head) and walks its slice of
the context ``BLOCK_N`` tokens at a time, looking each token's block up in
the block table::

    context of b:  [ split 0 | split 1 | ... | split S-1 ]   S = num_splits
    token t lives at kv_pool[block_tables[b, t // bs], layer, K|V, t % bs, g]

With one split the program writes the output; otherwise each split writes a
normalised partial output and its log-sum-exp (base 2) and a second kernel,
grid (B, heads), merges them.

An 8-bit pool (:mod:`pdcluster.kernels.kv_quant`) is read as raw bytes and each tile
dequantized in registers (``code * scale``, :mod:`pdcluster.kernels.triton_kv8`); q,
scores and the weighted sum of V are then fp32, as in the torch reference.
Its K rows are read as stored, shifted (K smoothing): every key of a query
carries the same shift, so its softmax is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.kernels.kv_quant import SCALE_BYTES, is_quantized
from pdcluster.kernels.triton_common import check_device, dot_f32, interpreting, next_pow2, online_softmax_step
from pdcluster.kernels.triton_kv8 import load_rows

BLOCK_N = 64            # context tokens per inner step (any block size)
MIN_SPLIT_TOKENS = 256  # never split a context finer than this


@triton.jit
def _decode_kernel(
    q_ptr, kv_ptr, bt_ptr, ctx_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale_log2, layer_offset,
    stride_qb, stride_qh, stride_kvb, stride_kvkv, stride_kvt, stride_kvh,
    stride_btb, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    TOKENS_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr,
    KV8: tl.constexpr, FP8: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(ctx_ptr + b)
    start = split * TOKENS_PER_SPLIT
    end = tl.minimum(start + TOKENS_PER_SPLIT, ctx_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = g * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if KV8:
        q = q.to(tl.float32)

    kv_base = kv_ptr + layer_offset + g * stride_kvh
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = block * stride_kvb + (offs_n % BLOCK_SIZE) * stride_kvt
        if KV8:
            k = load_rows(kv_base + rows, n_mask, offs_d, HEAD_DIM, FP8)
        else:
            k = tl.load(kv_base + rows[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                        other=0.0).to(q.dtype)
        s = dot_f32(q, tl.trans(k), UPCAST_DOT) * qk_scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        if KV8:
            v = load_rows(kv_base + stride_kvkv + rows, n_mask, offs_d, HEAD_DIM, FP8)
        else:
            v = tl.load(kv_base + stride_kvkv + rows[:, None] + offs_d[None, :],
                        mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, UPCAST_DOT)

    has_tokens = l_i > 0.0
    o = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    o_mask = h_mask[:, None] & d_mask[None, :]
    if SPLIT:
        part = b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + offs_d[None, :], o, mask=o_mask)
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        lse_ptrs = part_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split
        tl.store(lse_ptrs, lse, mask=h_mask)
    else:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part = b * stride_pb + h * stride_ph + offs_s * stride_ps
    o = tl.load(part_out_ptr + part[:, None] + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    den = tl.sum(w, axis=0)
    o = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(batch: int, kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Enough programs to fill the GPU ~4 waves deep, never a split under
    ``MIN_SPLIT_TOKENS`` tokens."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = triton.cdiv(4 * sms, batch * kv_heads)
    return max(1, min(wanted, triton.cdiv(max_tokens, MIN_SPLIT_TOKENS)))


def paged_decode_attention_triton(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as :func:`pdcluster.kernels.paged_decode_attention.paged_decode_attention_ref`.
    Launch grid (B, kv_heads, num_splits) [+ (B, heads) merge when split].
    Needs unit stride on q's and kv_pool's last dim; ``context_lens[b] >= 1``
    (a zero-length sequence gets zeros)."""
    check_device(q, kv_pool, block_tables, context_lens)
    batch, heads, head_dim = q.shape
    block_size, kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    kv8, fp8 = is_quantized(kv_pool.dtype), kv_pool.dtype is torch.float8_e4m3fn
    if kv_pool.shape[-1] != head_dim + (SCALE_BYTES if kv8 else 0):
        raise ValueError(f"q's head_dim {head_dim} does not fit the pool's {kv_pool.shape[-1]}-wide rows")
    if kv8:
        kv_pool = kv_pool.view(torch.uint8)  # raw rows: codes and scale bytes
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if q.stride(-1) != 1 or kv_pool.stride(-1) != 1:
        raise ValueError("paged_decode_attention_triton needs unit stride on head_dim")
    group = heads // kv_heads
    max_tokens = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, max_tokens, q.device)
    tokens_per_split = triton.cdiv(triton.cdiv(max_tokens, num_splits), BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(max_tokens, tokens_per_split)
    out = torch.empty_like(q)
    split = num_splits > 1
    part_out = torch.empty((batch, heads, num_splits, head_dim) if split else (1, 1, 1, 1),
                           dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, heads, num_splits) if split else (1, 1, 1), dtype=torch.float32, device=q.device)
    block_d = next_pow2(head_dim, 16)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, kv_pool, block_tables, context_lens, out, part_out, part_lse,
        scale * 1.4426950408889634, layer * kv_pool.stride(1),
        q.stride(0), q.stride(1), kv_pool.stride(0), kv_pool.stride(2), kv_pool.stride(3), kv_pool.stride(4),
        block_tables.stride(0), out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_H=next_pow2(group, 16), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, TOKENS_PER_SPLIT=tokens_per_split, SPLIT=split,
        UPCAST_DOT=interpreting(), KV8=kv8, FP8=fp8,
    )
    if split:
        _merge_splits_kernel[(batch, heads)](
            part_out, part_lse, out, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(num_splits),
        )
    return out
