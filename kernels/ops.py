"""The engine's only entry to kernels: Triton on CUDA, torch reference elsewhere.

Each op looks at one tensor's device: a CUDA tensor goes to the Triton kernel
when triton imports, anything else to the torch reference.  Triton modules
are imported lazily, on the first CUDA call, so CPU-only use never imports
triton.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch

from kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
from kernels.kv_write import write_kv_ref
from kernels.paged_decode_attention import paged_decode_attention_ref
from kernels.prefill_attention import prefill_attention_ref
from kernels.rmsnorm import fused_add_rmsnorm_ref, rmsnorm_ref
from kernels.rope import apply_rope_ref

__all__ = [
    "write_kv", "paged_decode_attention", "prefill_attention", "gather_blocks",
    "scatter_blocks", "rmsnorm", "fused_add_rmsnorm", "apply_rope", "triton_available",
]


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


@functools.cache
def _triton(module: str, name: str) -> Callable:
    return getattr(importlib.import_module(f"kernels.triton_{module}"), name)


def write_kv(
    kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    if _on_cuda(kv_pool):
        return _triton("kv_write", "write_kv_triton")(kv_pool, layer, k, v, slot_mapping)
    return write_kv_ref(kv_pool, layer, k, v, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    if _on_cuda(q):
        fn = _triton("paged_decode_attention", "paged_decode_attention_triton")
        return fn(q, kv_pool, layer, block_tables, context_lens, scale)
    return paged_decode_attention_ref(q, kv_pool, layer, block_tables, context_lens, scale)


def prefill_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    if _on_cuda(q):
        fn = _triton("prefill_attention", "prefill_attention_triton")
        return fn(q, kv_pool, layer, block_tables, query_start_loc, context_lens, scale)
    return prefill_attention_ref(q, kv_pool, layer, block_tables, query_start_loc, context_lens, scale)


def gather_blocks(kv_pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    if _on_cuda(kv_pool):
        return _triton("block_copy", "gather_blocks_triton")(kv_pool, block_ids)
    return gather_blocks_ref(kv_pool, block_ids)


def scatter_blocks(kv_pool: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    if _on_cuda(kv_pool):
        return _triton("block_copy", "scatter_blocks_triton")(kv_pool, block_ids, buffer)
    return scatter_blocks_ref(kv_pool, block_ids, buffer)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _on_cuda(x):
        return _triton("rmsnorm", "rmsnorm_triton")(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_cuda(x):
        return _triton("rmsnorm", "fused_add_rmsnorm_triton")(x, residual, weight, eps)
    return fused_add_rmsnorm_ref(x, residual, weight, eps)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_cuda(q):
        return _triton("rope", "apply_rope_triton")(q, k, positions, cos_cache, sin_cache)
    return apply_rope_ref(q, k, positions, cos_cache, sin_cache)
