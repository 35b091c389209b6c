"""Prefill attention over a cached prefix in Triton (ragged batch, paged KV).

One program owns (query tile m, sequence s, query head h): ``BLOCK_M`` of
the sequence's new tokens against every key they may see, ``BLOCK_N`` keys
at a time, with an online softmax.  Query row i (0-based inside the chunk)
sits at position ``prefix + i`` and sees keys ``0 .. prefix + i``::

    keys of s:  [ cached prefix (prefix = ctx - q_len) | new chunk (q_len) ]
    tile m:                                             [rows m*BM .. m*BM+BM)
    keys read:  0 .. prefix + min((m+1)*BM, q_len)      (causal upper bound)

Rows past ``q_len`` are clamped to the last real row (so no row is ever all
-inf) and never stored.  Launch grid (cdiv(max_q_len, BLOCK_M), S, heads).

An 8-bit pool (:mod:`pdcluster.kernels.kv_quant`) is read as raw bytes, each tile
dequantized in registers (:mod:`pdcluster.kernels.triton_kv8`) and rounded once to q's
dtype, as the torch reference does.  A sequence flagged fresh in
:class:`~pdcluster.kernels.prefill_attention.ChunkKV` reads its new tokens' K/V from
the chunk instead of the pool, and its prefix keys get ``k_shift`` back::

    key j <  prefix    pool row j, dequantized (+ k_shift when fresh)
    key j >= prefix    fresh: chunk row q_start + j - prefix; else pool row j
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.kernels.kv_quant import SCALE_BYTES, is_quantized
from pdcluster.kernels.prefill_attention import ChunkKV
from pdcluster.kernels.triton_common import check_device, dot_f32, interpreting, next_pow2, online_softmax_step
from pdcluster.kernels.triton_kv8 import load_rows

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _kv8_tile(pool_rows, chunk_ptrs, n_mask, from_chunk, shift, offs_d,
              HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """[BLOCK_N, BLOCK_D] fp32 keys or values: the chunk's own where
    ``from_chunk``, else the pool's rows dequantized plus ``shift`` (zeros for V)."""
    pooled = load_rows(pool_rows, n_mask & ~from_chunk, offs_d, HEAD_DIM, FP8) + shift[None, :]
    own = tl.load(chunk_ptrs, mask=from_chunk[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return tl.where(from_chunk[:, None], own.to(tl.float32), pooled)


@triton.jit
def _prefill_kernel(
    q_ptr, kv_ptr, bt_ptr, qsl_ptr, ctx_ptr, out_ptr,
    chunk_k_ptr, chunk_v_ptr, fresh_ptr, shift_ptr,
    qk_scale_log2, layer_offset,
    stride_qt, stride_qh, stride_kvb, stride_kvkv, stride_kvt, stride_kvh,
    stride_bts, stride_ot, stride_oh, stride_ckt, stride_ckh, stride_cvt, stride_cvh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr, KV8: tl.constexpr, FP8: tl.constexpr,
    HAS_CHUNK: tl.constexpr, HAS_SHIFT: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    prefix = tl.load(ctx_ptr + seq) - q_len
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = prefix + tl.minimum(offs_m, q_len - 1)
    # An empty tile (past q_len) reads no keys and stores nothing.
    kv_end = tl.where(tile * BLOCK_M < q_len, prefix + tl.minimum((tile + 1) * BLOCK_M, q_len), 0)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    kv_head = head // GROUP
    kv_base = kv_ptr + layer_offset + kv_head * stride_kvh
    # Keys from chunk_from on come from the chunk: the new tokens of a fresh sequence, none of another.
    # (Scalar flags enter masks as bounds: the interpreter cannot AND a scalar bool into a block mask.)
    chunk_from = 1 << 30
    shifted_dims = 0
    if HAS_CHUNK:
        fresh = tl.load(fresh_ptr + seq) != 0
        chunk_from = tl.where(fresh, prefix, 1 << 30)
        shifted_dims = tl.where(fresh, HEAD_DIM, 0)
    no_shift = tl.zeros([BLOCK_D], tl.float32)
    k_shift = no_shift
    if HAS_SHIFT:  # added back to a fresh sequence's prefix keys only
        k_shift = tl.load(shift_ptr + kv_head * HEAD_DIM + offs_d, mask=offs_d < shifted_dims, other=0.0)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        pool_rows = kv_base + block * stride_kvb + (offs_n % BLOCK_SIZE) * stride_kvt
        if KV8:
            from_chunk = n_mask & (offs_n >= chunk_from)
            chunk_rows = (q_start + tl.maximum(offs_n - prefix, 0)).to(tl.int64)
            k_ptrs = chunk_k_ptr + chunk_rows[:, None] * stride_ckt + kv_head * stride_ckh + offs_d[None, :]
            k = _kv8_tile(pool_rows, k_ptrs, n_mask, from_chunk, k_shift, offs_d, HEAD_DIM, FP8)
            v_ptrs = chunk_v_ptr + chunk_rows[:, None] * stride_cvt + kv_head * stride_cvh + offs_d[None, :]
            v = _kv8_tile(pool_rows + stride_kvkv, v_ptrs, n_mask, from_chunk, no_shift, offs_d,
                          HEAD_DIM, FP8)
            k, v = k.to(q.dtype), v.to(q.dtype)
        else:
            ptrs = pool_rows[:, None] + offs_d[None, :]
            tile_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(ptrs, mask=tile_mask, other=0.0).to(q.dtype)
            v = tl.load(ptrs + stride_kvkv, mask=tile_mask, other=0.0).to(q.dtype)
        s = dot_f32(q, tl.trans(k), UPCAST_DOT) * qk_scale_log2
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, UPCAST_DOT)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention_triton(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    chunk: ChunkKV | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Same contract as :func:`pdcluster.kernels.prefill_attention.prefill_attention_ref`.
    ``max_query_len`` sizes the grid; when omitted it is read from
    ``query_start_loc`` (one device sync).  Needs unit stride on head_dim."""
    check_device(q, kv_pool, block_tables, query_start_loc, context_lens)
    num_tokens, heads, head_dim = q.shape
    block_size, kv_heads = kv_pool.shape[3], kv_pool.shape[4]
    kv8, fp8 = is_quantized(kv_pool.dtype), kv_pool.dtype is torch.float8_e4m3fn
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    if kv_pool.shape[-1] != head_dim + (SCALE_BYTES if kv8 else 0):
        raise ValueError(f"q's head_dim {head_dim} does not fit the pool's {kv_pool.shape[-1]}-wide rows")
    if q.stride(-1) != 1 or kv_pool.stride(-1) != 1:
        raise ValueError("prefill_attention_triton needs unit stride on head_dim")
    if chunk is not None:
        chunk.check(q, kv_pool, context_lens.shape[0])
        if chunk.k.stride(-1) != 1 or chunk.v.stride(-1) != 1:
            raise ValueError("prefill_attention_triton needs unit stride on the chunk's head_dim")
    # Absent chunk tensors: any tensor stands in (never read: HAS_CHUNK / HAS_SHIFT are off).
    ck, cv, fresh = (q, q, context_lens) if chunk is None else (chunk.k, chunk.v, chunk.fresh)
    shift = q if chunk is None or chunk.k_shift is None else chunk.k_shift.contiguous()
    if kv8:
        kv_pool = kv_pool.view(torch.uint8)  # raw rows: codes and scale bytes
    out = torch.empty_like(q)
    num_seqs = context_lens.shape[0]
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if num_tokens == 0 or max_query_len == 0:
        return out
    grid = (triton.cdiv(max_query_len, BLOCK_M), num_seqs, heads)
    _prefill_kernel[grid](
        q, kv_pool, block_tables, query_start_loc, context_lens, out, ck, cv, fresh, shift,
        scale * 1.4426950408889634, layer * kv_pool.stride(1),
        q.stride(0), q.stride(1), kv_pool.stride(0), kv_pool.stride(2), kv_pool.stride(3), kv_pool.stride(4),
        block_tables.stride(0), out.stride(0), out.stride(1), ck.stride(0), ck.stride(1), cv.stride(0), cv.stride(1),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim, 16),
        BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, UPCAST_DOT=interpreting(),
        KV8=kv8, FP8=fp8, HAS_CHUNK=chunk is not None, HAS_SHIFT=chunk is not None and chunk.k_shift is not None,
    )
    return out
