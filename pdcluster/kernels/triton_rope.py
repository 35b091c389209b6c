"""RoPE in Triton, in place on q and k (Llama/HF "rotate half")::

    x = [x1 | x2]    out = [x1*cos1 - x2*sin1 | x2*cos2 + x1*sin2]

One program per token t: it loads the token's cos/sin row (fp32 cache
[max_pos, head_dim], read at ``positions[t]``) once and rotates all of the
token's q heads, then all of its k heads, as [BLOCK_H, HALF] tiles.  Like the
reference, cos/sin are rounded to q's dtype and each product is rounded
before the sum.  Launch grid (T,).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.kernels.triton_common import check_device, next_pow2


@triton.jit
def _rotate_heads(x_ptr, stride_h, heads, c1, c2, s1, s2, offs_d, d_mask,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < heads) & d_mask[None, :]
    p1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    o1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(p1, o1.to(dt), mask=mask)
    tl.store(p1 + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, q_heads, k_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    dt = q_ptr.dtype.element_ty
    row = pos * stride_cache + offs_d
    c1 = tl.load(cos_ptr + row, mask=d_mask, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF, mask=d_mask, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + row, mask=d_mask, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF, mask=d_mask, other=0.0).to(dt).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, q_heads, c1, c2, s1, s2, offs_d, d_mask, BLOCK_HQ, HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, k_heads, c1, c2, s1, s2, offs_d, d_mask, BLOCK_HK, HALF)


def apply_rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`pdcluster.kernels.rope.apply_rope_ref` (q and k share a
    dtype; unit stride on head_dim; any token/head strides, e.g. views of a
    fused qkv buffer)."""
    check_device(q, k, positions, cos_cache, sin_cache)
    num_tokens, q_heads, head_dim = q.shape
    if k.dtype != q.dtype or head_dim % 2 or k.shape[-1] != head_dim:
        raise ValueError("apply_rope_triton needs q and k of one dtype and one even head_dim")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_cache.stride(-1) != 1 or sin_cache.stride() != cos_cache.stride():
        raise ValueError("apply_rope_triton needs unit stride on head_dim and like cos/sin caches")
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos_cache, sin_cache, q_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        HALF=half, BLOCK_HALF=next_pow2(half), BLOCK_HQ=next_pow2(q_heads), BLOCK_HK=next_pow2(k.shape[1]),
    )
    return q, k
