"""Block gather/scatter in Triton: pack KV blocks into one contiguous buffer
and unpack it back.

A block ``kv_pool[b]`` (all layers, K and V) is one contiguous run of
``block_numel`` elements, so both directions are flat copies: program
(i, c) moves chunk c (``CHUNK`` elements) of the i-th listed block.
Launch grid (n, cdiv(block_numel, CHUNK)).

One-byte pools (8-bit KV: codes and bf16 scale bytes side by side) are
copied as ``uint8``: a scale byte is not a value of the pool's dtype (as an
e4m3 code it may be NaN), so it must never pass through a float conversion.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdcluster.kernels.triton_common import check_device

CHUNK = 4096


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, ids_ptr, block_numel, stride_src, stride_dst,
    IDS_ON_SRC: tl.constexpr, CHUNK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    block = tl.load(ids_ptr + i).to(tl.int64)
    src_row = block if IDS_ON_SRC else i
    dst_row = i if IDS_ON_SRC else block
    x = tl.load(src_ptr + src_row * stride_src + offs, mask=mask)
    # Cast through fp32: the CPU interpreter cannot convert bf16 <-> fp16 directly.
    tl.store(dst_ptr + dst_row * stride_dst + offs, x.to(tl.float32).to(dst_ptr.dtype.element_ty), mask=mask)


def _block_numel(kv_pool: torch.Tensor) -> int:
    numel = math.prod(kv_pool.shape[1:])
    if not kv_pool[:1].is_contiguous() and kv_pool.shape[0] > 0:
        raise ValueError("block copy needs each block kv_pool[b] to be contiguous")
    return numel


def _launch(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, ids_on_src: bool) -> None:
    numel = _block_numel(src if ids_on_src else dst)
    if src.element_size() == dst.element_size() == 1:
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    ids = block_ids.to(device=src.device)
    if ids.numel() == 0 or numel == 0:
        return
    grid = (ids.numel(), triton.cdiv(numel, CHUNK))
    _copy_blocks_kernel[grid](src, dst, ids, numel, src.stride(0), dst.stride(0),
                              IDS_ON_SRC=ids_on_src, CHUNK=CHUNK)


def gather_blocks_triton(kv_pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`pdcluster.kernels.block_copy.gather_blocks_ref`."""
    check_device(kv_pool)
    out = torch.empty((block_ids.numel(), *kv_pool.shape[1:]), dtype=kv_pool.dtype, device=kv_pool.device)
    _launch(kv_pool, out, block_ids, ids_on_src=True)
    return out


def scatter_blocks_triton(kv_pool: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Same contract as :func:`pdcluster.kernels.block_copy.scatter_blocks_ref`."""
    check_device(kv_pool, buffer)
    if buffer.shape != (block_ids.numel(), *kv_pool.shape[1:]):
        raise ValueError(f"buffer shape {tuple(buffer.shape)} does not match "
                         f"{block_ids.numel()} blocks of {tuple(kv_pool.shape[1:])}")
    if kv_pool.element_size() == 1 and buffer.element_size() != 1:
        raise ValueError(f"a {kv_pool.dtype} pool's blocks are raw bytes: scatter a buffer of one-byte elements "
                         f"(uint8 or {kv_pool.dtype}), not {buffer.dtype}")
    _launch(buffer.contiguous(), kv_pool, block_ids, ids_on_src=False)
