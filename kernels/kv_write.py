"""Scatter freshly computed K/V of one layer into their pool slots."""

from __future__ import annotations

import torch


def write_kv_ref(
    kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """``k``, ``v``: [T, kv_heads, head_dim]; ``slot_mapping``: [T] int64
    (``block_id * block_size + offset``; every slot must be valid).  Writes in
    place, as two row copies into the pool viewed as rows of one token::

        row(block, layer, K|V, offset) = ((block * L + layer) * 2 + K|V) * bs + offset
    """
    num_layers, block_size = kv_pool.shape[1], kv_pool.shape[3]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    rows = (blocks * num_layers + layer) * 2 * block_size + (slot_mapping - blocks * block_size)
    flat = kv_pool.view(-1, kv_pool.shape[4], kv_pool.shape[5])
    flat.index_copy_(0, rows, k.to(kv_pool.dtype))
    flat.index_copy_(0, rows + block_size, v.to(kv_pool.dtype))
