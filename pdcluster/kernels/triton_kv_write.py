"""KV write in Triton: scatter one step's fresh K/V of one layer into the pool.

One program per token t: it reads ``k[t]``, ``v[t]`` ([kv_heads, head_dim]
tiles, any token/head strides) and writes them to
``kv_pool[slot // bs, layer, K|V, slot % bs]``.  A negative slot (a padding
token) is skipped.  Launch grid (T,).

An 8-bit pool (:mod:`pdcluster.kernels.kv_quant`) gets each row quantized in
registers (K minus ``k_shift`` first), its bf16 scale beside it: the same
bytes as :func:`pdcluster.kernels.kv_write.write_kv_ref` (:mod:`pdcluster.kernels.triton_kv8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.kernels.kv_quant import SCALE_BYTES, is_quantized
from pdcluster.kernels.triton_common import check_device, next_pow2
from pdcluster.kernels.triton_kv8 import encode_rows, store_rows


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


@triton.jit
def _kv8_write_kernel(
    k_ptr, v_ptr, kv_ptr, slot_ptr, shift_ptr, layer_offset,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kvb, stride_kvkv, stride_kvt, stride_kvh,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_SHIFT: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < tl.where(slot >= 0, KV_HEADS, 0)  # a padding token writes nothing
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    k = k.to(tl.float32)
    if HAS_SHIFT:
        k = k - tl.load(shift_ptr + offs_h[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    rows = (kv_ptr + layer_offset + (slot // BLOCK_SIZE) * stride_kvb + (slot % BLOCK_SIZE) * stride_kvt
            + offs_h * stride_kvh)
    codes, scales = encode_rows(k, FP8)
    store_rows(rows, codes, scales, h_mask, offs_d, HEAD_DIM)
    codes, scales = encode_rows(v.to(tl.float32), FP8)
    store_rows(rows + stride_kvkv, codes, scales, h_mask, offs_d, HEAD_DIM)


def write_kv_triton(
    kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    k_shift: torch.Tensor | None = None,
) -> None:
    """Same contract as :func:`pdcluster.kernels.kv_write.write_kv_ref` (negative slots
    are skipped).  Needs unit stride on head_dim."""
    check_device(kv_pool, k, v, slot_mapping)
    num_tokens, kv_heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_pool.stride(-1) != 1:
        raise ValueError("write_kv_triton needs unit stride on head_dim")
    if is_quantized(kv_pool.dtype):
        return _write_kv8(kv_pool, layer, k, v, slot_mapping, k_shift)
    if k_shift is not None:
        raise ValueError(f"k_shift (K smoothing) applies to 8-bit pools only; this pool is {kv_pool.dtype}: pass None")
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k, v, kv_pool, slot_mapping, layer * kv_pool.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_pool.stride(0), kv_pool.stride(2), kv_pool.stride(3), kv_pool.stride(4),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(kv_heads),
        BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=kv_pool.shape[3],
    )


def _write_kv8(kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
               k_shift: torch.Tensor | None) -> None:
    num_tokens, kv_heads, head_dim = k.shape
    if kv_pool.shape[-1] != head_dim + SCALE_BYTES:
        raise ValueError(f"an 8-bit pool's rows are head_dim + {SCALE_BYTES} wide: got {kv_pool.shape[-1]} for "
                         f"head_dim {head_dim}")
    if k_shift is not None and (tuple(k_shift.shape) != (kv_heads, head_dim) or k_shift.dtype != torch.float32
                                or not k_shift.is_contiguous()):
        raise ValueError(f"k_shift must be contiguous float32 of shape {(kv_heads, head_dim)}, got "
                         f"{k_shift.dtype} {tuple(k_shift.shape)}")
    if num_tokens == 0:
        return
    raw = kv_pool.view(torch.uint8)  # same shape and strides: one byte per element
    _kv8_write_kernel[(num_tokens,)](
        k, v, raw, slot_mapping, k if k_shift is None else k_shift, layer * raw.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        raw.stride(0), raw.stride(2), raw.stride(3), raw.stride(4),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(kv_heads),
        BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=raw.shape[3], HAS_SHIFT=k_shift is not None,
        FP8=kv_pool.dtype is torch.float8_e4m3fn,
    )
