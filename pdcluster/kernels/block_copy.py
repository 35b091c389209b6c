"""Pack a list of KV blocks into one contiguous buffer and back (the portable
transfer path and host-side staging use these)."""

from __future__ import annotations

import torch


def gather_blocks_ref(kv_pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Returns a contiguous [n, *kv_pool.shape[1:]] copy of ``block_ids``."""
    return kv_pool.index_select(0, block_ids.long())


def scatter_blocks_ref(kv_pool: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Writes ``buffer`` [n, *kv_pool.shape[1:]] into ``block_ids`` in place."""
    kv_pool.index_copy_(0, block_ids.long(), buffer.to(kv_pool.dtype))
