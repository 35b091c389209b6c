"""8-bit KV rows: the format every kernel reads and writes when the pool is
int8 or fp8 (e4m3), and its torch reference quantize / dequantize.

An 8-bit pool keeps the block-major shape, each (token, kv head) row
``head_dim + 2`` bytes wide, its scale stored beside it::

    kv_pool[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + 2]   (int8 | float8_e4m3fn)

    one row:  | q[0] q[1] ... q[head_dim-1] | scale (bf16, little-endian) |
    value[i] = q[i] * scale      symmetric, one scale per token and kv head

So a block (all layers, K and V, payloads and scales) is still one contiguous
region: a transfer moves the scales with the block without knowing they are
there.  A per-token scale is fixed when the token is written (decode appends
one token at a time, so a per-block scale would have to be re-derived and the
block re-quantized as it fills).  The scale is bf16: fp32's range, so no
overflow or underflow handling, and 2 bytes instead of 4, which keeps a
64-wide row at 66 / 128 bytes of bf16's (capacity x1.94).

Every kernel reads and writes these rows directly: the torch reference
here, the native CPU kernels (pdcluster/kernels/csrc/kv8_kernels.h) and the Triton
kernels (pdcluster/kernels/triton_kv8.py: codes and scales dequantized in registers).

Quantizing (bit-exact in every implementation, so native, Triton and
reference pools hold the same bytes)::

    scale = bf16(amax(|x|) / QMAX)           QMAX: 127 (int8), 448 (e4m3)
    q     = int8:  clamp(round_half_even(x / scale), -127, 127)
            e4m3:  e4m3_round_nearest_even(clamp(x / scale, -448, 448))
    scale == 0 (an all-zero row): q = 0

K smoothing: K rows are quantized after subtracting a fixed per-(layer, kv
head, channel) vector ``b`` (``k_shift``), so the row's scale follows the
spread of K rather than its outlier channels' constant offset::

    K row stored = quantize(k - b)           V rows: never shifted

Decode needs no add-back: for any query q, q . (k_j - b) = q . k_j - q . b,
and q . b is the same for every key j of that query's (layer, kv head), so
the softmax over keys is unchanged.  It stays exact only while every key a
query sees carries the same shift: every K row of an 8-bit pool is written
shifted (decode, prefill chunks, speculative verification all write through
``write_kv`` before attending), and ``b`` is a pure function of the weights
(pdcluster/services/engine/model/k_smoothing.py), part of the block hash seed
(pdcluster/services/model_meta.py), so shifted blocks never meet other shifts across
replicas.  bf16/fp32 pools are never shifted.

K rotation: before that, the model turns q and post-RoPE K of every head by
one orthonormal Hadamard matrix H (pdcluster/kernels/kv_rotation.py), which leaves
q . k unchanged and spreads K's outlier channels over the row (int8 KV's
greedy count 7 -> 12 of 16 there).  So an 8-bit pool's K rows hold
``quantize(H k - H b)``: every kernel here sees an ordinary K row and an
ordinary shift (``H b``), and none of them knows about the rotation.  Also
in the block-hash seed; bf16/fp32 pools are never rotated.

Prompt chunks read the pool for their cached prefix only: their own keys and
values are the model's, as computed, never quantized, so quantization error
never enters the hidden states of the tokens being prefilled.  Those keys are unshifted, so the prefix's K rows
get ``b`` added back as they are dequantized: every key the chunk sees is
unshifted (pdcluster/kernels/prefill_attention.py draws it).  Verifying a draft reads
every key from the pool, shifted, as the decode steps it stands for do.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2  # a bf16 scale after each row's payload
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8_e4m3")  # config names; auto: the model's dtype
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element dtype for a config value."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return {"auto": model_dtype, "bf16": torch.bfloat16, "int8": torch.int8,
            "fp8_e4m3": torch.float8_e4m3fn}[kv_cache_dtype]


def kv_dtype_label(dtype: torch.dtype) -> str:
    """The config-style name of a pool dtype, for status and plans."""
    return {torch.bfloat16: "bf16", torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3",
            torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype).removeprefix("torch."))


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, kv head) row in a pool of ``dtype``."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def pool_head_dim(kv_pool: torch.Tensor) -> int:
    """The model's head_dim, read off a pool of either format."""
    return kv_pool.shape[-1] - SCALE_BYTES if is_quantized(kv_pool.dtype) else kv_pool.shape[-1]


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, shift: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., head_dim] (any float dtype) -> packed rows [..., head_dim + 2]
    of ``dtype`` (int8 or float8_e4m3fn), scales included.  ``shift`` (fp32,
    broadcast against ``x``; K smoothing) is subtracted in fp32 first."""
    qmax = _QMAX[dtype]
    xf = x.float() if shift is None else x.float() - shift
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).to(torch.bfloat16)
    s = scale.float()
    scaled = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
    if dtype is torch.int8:
        payload = scaled.round().clamp_(-qmax, qmax).to(torch.int8).view(torch.uint8)
    else:
        payload = scaled.clamp_(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    scale_bytes = scale.contiguous().view(torch.uint8)  # [..., 2], little-endian like the C side
    return torch.cat([payload, scale_bytes], dim=-1).view(dtype)


def dequantize_rows(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows [..., head_dim + 2] -> values [..., head_dim] in ``out_dtype``
    (computed in fp32, rounded once)."""
    raw = rows.contiguous().view(torch.uint8)
    d = raw.shape[-1] - SCALE_BYTES
    payload = raw[..., :d].view(rows.dtype).float()
    scale = raw[..., d:].contiguous().view(torch.bfloat16).float()
    return (payload * scale).to(out_dtype)
