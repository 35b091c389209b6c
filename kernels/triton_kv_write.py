"""KV write in Triton: scatter one step's fresh K/V of one layer into the pool.

One program per token t: it reads ``k[t]``, ``v[t]`` ([kv_heads, head_dim]
tiles, any token/head strides) and writes them to
``kv_pool[slot // bs, layer, K|V, slot % bs]``.  A negative slot (a padding
token) is skipped.  Launch grid (T,).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_device, next_pow2


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, kv_ptr, slot_ptr, layer_offset,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kvb, stride_kvkv, stride_kvt, stride_kvh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = tl.where(slot >= 0, KV_HEADS, 0)  # a padding token writes nothing
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = (kv_ptr + layer_offset + (slot // BLOCK_SIZE) * stride_kvb + (slot % BLOCK_SIZE) * stride_kvt
           + offs_h[:, None] * stride_kvh + offs_d[None, :])
    # Cast through fp32: the CPU interpreter cannot convert bf16 <-> fp16 directly.
    tl.store(dst, k.to(tl.float32).to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kvkv, v.to(tl.float32).to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`kernels.kv_write.write_kv_ref` (negative slots
    are skipped).  Needs unit stride on head_dim."""
    check_device(kv_pool, k, v, slot_mapping)
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_pool.stride(-1) != 1:
        raise ValueError("write_kv_triton needs unit stride on head_dim")
    _kv_write_kernel[(num_tokens,)](
        k, v, kv_pool, slot_mapping, layer * kv_pool.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_pool.stride(0), kv_pool.stride(2), kv_pool.stride(3), kv_pool.stride(4),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(kv_heads),
        BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=kv_pool.shape[3],
    )
