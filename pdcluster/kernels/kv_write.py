"""Scatter freshly computed K/V of one layer into their pool slots."""

from __future__ import annotations

import torch

from pdcluster.kernels.kv_quant import is_quantized, quantize_rows


def write_kv_ref(
    kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    k_shift: torch.Tensor | None = None,
) -> None:
    """``k``, ``v``: [T, kv_heads, head_dim]; ``slot_mapping``: [T] int64
    (``block_id * block_size + offset``; every slot must be valid).  Writes in
    place, as two row copies into the pool viewed as rows of one token::

        row(block, layer, K|V, offset) = ((block * L + layer) * 2 + K|V) * bs + offset

    An 8-bit pool (:mod:`pdcluster.kernels.kv_quant`) gets each row quantized, its
    scale beside it, K rows after subtracting ``k_shift`` [kv_heads, head_dim]
    (fp32, K smoothing; 8-bit pools only)."""
    num_layers, block_size = kv_pool.shape[1], kv_pool.shape[3]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    rows = (blocks * num_layers + layer) * 2 * block_size + (slot_mapping - blocks * block_size)
    if is_quantized(kv_pool.dtype):  # index_copy_ has no float8 kernel: move the bytes
        flat = kv_pool.view(torch.uint8).view(-1, kv_pool.shape[4], kv_pool.shape[5])
        k = quantize_rows(k, kv_pool.dtype, k_shift).view(torch.uint8)
        v = quantize_rows(v, kv_pool.dtype).view(torch.uint8)
    elif k_shift is not None:
        raise ValueError(f"k_shift (K smoothing) applies to 8-bit pools only; this pool is {kv_pool.dtype}: pass None")
    else:
        flat = kv_pool.view(-1, kv_pool.shape[4], kv_pool.shape[5])
        k, v = k.to(kv_pool.dtype), v.to(kv_pool.dtype)
    flat.index_copy_(0, rows, k)
    flat.index_copy_(0, rows + block_size, v)
