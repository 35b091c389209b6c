"""Scatter freshly computed K/V of one layer into their pool slots."""

from __future__ import annotations

import torch


def write_kv_ref(
    kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """``k``, ``v``: [T, kv_heads, head_dim]; ``slot_mapping``: [T] int64
    (``block_id * block_size + offset``).  Writes in place."""
    block_size = kv_pool.shape[3]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    kv_pool[blocks, layer, 0, offsets] = k.to(kv_pool.dtype)
    kv_pool[blocks, layer, 1, offsets] = v.to(kv_pool.dtype)
