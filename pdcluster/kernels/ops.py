"""The engine's only entry to kernels: Triton on CUDA, native C kernels for
bf16 on CPUs with AMX, AVX-512 BF16 or AVX2+FMA (:mod:`pdcluster.kernels.cpu_native`
picks the variant; :func:`linear_path` says which kernel a linear runs), the
torch reference elsewhere.

8-bit KV pools (int8, fp8 e4m3: :mod:`pdcluster.kernels.kv_quant`): the Triton kernels
(on CUDA) and the native kernels (``cpu_native.handles_pool``) read and write
them; wherever neither runs, the torch references do.  Every path reads the
rows through their scales, and a prompt chunk's own K/V through ``ChunkKV``.
Their q and K are Hadamard-rotated first (:mod:`pdcluster.kernels.kv_rotation`):
``rotate_heads`` is torch on every device (butterflies of a few elementwise
ops), and the native stack turns its own rows, bit for bit the same.

Each op looks at its tensors: CUDA tensors go to the Triton kernel when
triton imports; CPU bf16 tensors of a supported shape go to
:mod:`pdcluster.kernels.cpu_native`; anything else to the torch reference.  Triton
modules are imported lazily, on the first CUDA call, so CPU-only use never
imports triton.

Also here, so that nothing outside pdcluster/kernels/ reaches past this module: the
whole-stack native path (:func:`decoder_stack`), the native work pool's size
and the name of the variant in use, the RoPE caches the ops read, and
:func:`on_huge_pages` for the weights a decode step streams.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from pdcluster.kernels import cpu_native, greedy_head, int8_linear
from pdcluster.kernels.activation import silu_mul_ref
from pdcluster.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
from pdcluster.kernels.cpu_native import DecoderStack
from pdcluster.kernels.greedy_head import ScreenedHead
from pdcluster.kernels.huge_pages import on_huge_pages
from pdcluster.kernels.kv_quant import is_quantized
from pdcluster.kernels.int8_linear import dequantize as dequantize_int8_weight
from pdcluster.kernels.int8_linear import from_gguf_blocks as int8_weight_from_gguf
from pdcluster.kernels.int8_linear import quantize_groups as quantize_int8_weight
from pdcluster.kernels.kv_rotation import rotate_heads, rotates
from pdcluster.kernels.kv_write import write_kv_ref
from pdcluster.kernels.paged_decode_attention import paged_decode_attention_ref
from pdcluster.kernels.prefill_attention import ChunkKV, prefill_attention_ref
from pdcluster.kernels.rmsnorm import fused_add_rmsnorm_ref, rmsnorm_ref
from pdcluster.kernels.rope import apply_rope_ref, rope_cos_sin

__all__ = [
    "write_kv", "paged_decode_attention", "prefill_attention", "gather_blocks",
    "scatter_blocks", "rmsnorm", "fused_add_rmsnorm", "apply_rope", "linear", "linear_path", "pack_linear_weight",
    "unpack_linear_weight", "pack_int8_linear_weight", "quantize_int8_weight", "int8_weight_from_gguf",
    "dequantize_int8_weight", "silu_mul", "triton_available", "rotate_heads", "rotates",
    "ChunkKV", "DecoderStack", "decoder_stack", "decoder_stack_takes", "set_native_threads", "native_variant", "rope_cos_sin",
    "on_huge_pages", "argmax_rows", "build_greedy_head", "greedy_choice", "GREEDY_SCREEN_ROWS", "ScreenedHead",
]

GREEDY_SCREEN_ROWS = greedy_head.SCREEN_ROWS


def build_greedy_head(weight: torch.Tensor, keep_in: Path | None = None) -> ScreenedHead | None:
    """The int8 screen of a bf16 LM head ``weight`` [V, K] (kernels/greedy_head.py), or None where it
    cannot run here; ``keep_in``: a directory where it is kept once built (greedy_head_file.py)."""
    return greedy_head.build(weight, keep_in)


def greedy_choice(head: ScreenedHead, packed: torch.Tensor, x: torch.Tensor) -> list[int] | None:
    """Each row's argmax of ``x`` times the packed bf16 head, through the screen ``head``; None: run the
    full head."""
    return greedy_head.choose(head, packed, x)


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
    return getattr(importlib.import_module(f"pdcluster.kernels.triton_{module}"), name)


def _triton_kv(kv_pool: torch.Tensor) -> bool:
    """The Triton KV kernels take every pool dtype, 8-bit rows included."""
    return _on_cuda(kv_pool)


def _rows_ok(*tensors: torch.Tensor) -> bool:
    """[T, heads, d] views whose rows may be strided but whose heads are packed."""
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in tensors)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in the layout :func:`linear` runs fastest on here:
    packed for the native CPU kernels when they take it (a 4-D tensor of the
    same size), else unchanged."""
    if weight.dim() == 2 and cpu_native.handles(weight) and cpu_native.packable(weight):
        return cpu_native.pack_weight(weight)
    return weight


def _native_attention(q: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """The native attention kernels take bf16 CPU q (rows may be strided) over
    a contiguous bf16 or 8-bit pool, head_dim a multiple of 32, whole GQA groups."""
    return (cpu_native.handles(q) and cpu_native.handles_pool(kv_pool) and _rows_ok(q) and q.shape[2] % 32 == 0
            and q.shape[1] % kv_pool.shape[4] == 0)


def unpack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """The plain [N, K] weight (a copy) of one :func:`pack_linear_weight`
    returned; any other tensor unchanged."""
    if weight.dim() != 4:
        return weight
    tiles, half_k, tile, pair = weight.shape  # cpu_native.pack_weight: [N / tile, K / 2, tile, 2]
    return weight.permute(0, 2, 1, 3).reshape(tiles * tile, half_k * pair)


def argmax_rows(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """For fp32 ``logits`` [rows, vocab]: each row's argmax (the first index of its largest value,
    as ``torch.argmax`` breaks ties) and whether the row holds only finite values.  The native
    kernel (csrc/logits_argmax.h) does both in one pass on the CPU; torch elsewhere, with one
    device sync."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_cpu and logits.shape[1] > 0
            and cpu_native.available()):
        return cpu_native.argmax_rows(logits)
    best, finite = torch.stack([logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1).long()]).tolist()
    return best, [bool(f) for f in finite]


def native_build() -> str | None:
    """The native CPU kernels' loaded build (its file name: variant and a hash of source and flags),
    or None when the torch references run (``cpu_native.loaded_library_name``)."""
    return cpu_native.loaded_library_name()


def linear_path(m: int, n: int, k: int) -> str:
    """Which kernel :func:`linear` runs for x [m, k] times a packed [n, k]
    weight on this machine: "amx", "dot" or "torch" (``cpu_native.linear_path``)."""
    variant = cpu_native.loaded_variant()
    return cpu_native.linear_path(m, n, k, variant, variant == "amx_bf16" and cpu_native.amx_ready())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           w_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; ``weight`` as given or as returned by :func:`pack_linear_weight`, or int8 in groups of 32
    (``weight_dtype: int8``: pdcluster/kernels/int8_linear.py): [N, K] codes with ``w_scales`` [N, K/32, 2]
    (d, m), or as :func:`pack_int8_linear_weight` packed them (their scales inside)."""
    if weight.dtype == torch.int8:
        return _int8_linear(x, weight, bias, w_scales)
    if weight.dim() == 4:
        return cpu_native.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 w_scales: torch.Tensor | None) -> torch.Tensor:
    """The native kernel for packed weights and bf16 CPU rows, the Triton kernel on CUDA, else the torch
    reference."""
    if int8_linear.is_packed_int8(weight):
        if int8_linear.native_takes(x):
            return int8_linear.linear_native(x, weight, bias)
        weight, w_scales = int8_linear.unpack_int8_weight(weight)
    if w_scales is None:
        raise ValueError("an int8 [N, K] weight needs its w_scales [N, K/32, 2]")
    if _on_cuda(x):
        return _triton("int8_linear", "int8_linear_triton")(x, weight, w_scales, bias)
    return int8_linear.int8_linear_ref(x, weight, w_scales, bias)


def pack_int8_linear_weight(codes: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in the layout :func:`linear` runs fastest on here: packed with their
    scales for the native CPU kernels when they take it, else unchanged (keep ``w_scales`` then)."""
    if codes.is_cpu and cpu_native.available() and int8_linear.packable(codes):
        return int8_linear.pack_int8_weight(codes, w_scales)
    return codes


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dim() == 2 and gate_up.is_contiguous() and cpu_native.handles(gate_up):
        return cpu_native.silu_mul(gate_up)
    return silu_mul_ref(gate_up)


def write_kv(
    kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    k_shift: torch.Tensor | None = None,
) -> None:
    """``k_shift``: None, or this layer's [kv_heads, head_dim] fp32 K
    smoothing shift, subtracted from K before quantizing (8-bit pools only:
    :mod:`pdcluster.kernels.kv_quant`)."""
    if k_shift is not None and not is_quantized(kv_pool.dtype):
        raise ValueError(f"k_shift (K smoothing) applies to 8-bit pools only; this pool is {kv_pool.dtype}: pass None")
    if _triton_kv(kv_pool):
        return _triton("kv_write", "write_kv_triton")(kv_pool, layer, k, v, slot_mapping, k_shift)
    if (cpu_native.handles(k, v) and cpu_native.handles_pool(kv_pool) and _rows_ok(k, v)
            and k.stride(0) == v.stride(0)):
        return cpu_native.write_kv(kv_pool, layer, k, v, slot_mapping, k_shift)
    return write_kv_ref(kv_pool, layer, k, v, slot_mapping, k_shift)


def paged_decode_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    if _on_cuda(q) and _triton_kv(kv_pool):
        fn = _triton("paged_decode_attention", "paged_decode_attention_triton")
        return fn(q, kv_pool, layer, block_tables, context_lens, scale)
    if _native_attention(q, kv_pool):
        return cpu_native.paged_decode_attention(q, kv_pool, layer, block_tables, context_lens, scale)
    return paged_decode_attention_ref(q, kv_pool, layer, block_tables, context_lens, scale)


def prefill_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float, chunk: ChunkKV | None = None,
) -> torch.Tensor:
    """``chunk``: None, or the new tokens' own K/V, which prompt chunks over
    an 8-bit pool attend to instead of their quantized rows
    (:mod:`pdcluster.kernels.prefill_attention`); plain pools take None."""
    if chunk is not None:
        chunk.check(q, kv_pool, context_lens.shape[0])
    if _on_cuda(q) and _triton_kv(kv_pool):
        fn = _triton("prefill_attention", "prefill_attention_triton")
        return fn(q, kv_pool, layer, block_tables, query_start_loc, context_lens, scale, chunk)
    if _native_attention(q, kv_pool):
        return cpu_native.prefill_attention(q, kv_pool, layer, block_tables, query_start_loc, context_lens, scale,
                                            chunk)
    return prefill_attention_ref(q, kv_pool, layer, block_tables, query_start_loc, context_lens, scale, chunk)


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
    if cpu_native.handles(x, weight) and x.is_contiguous():
        return cpu_native.fused_add_rmsnorm(None, x, weight, eps)[0]
    return rmsnorm_ref(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_cuda(x):
        return _triton("rmsnorm", "fused_add_rmsnorm_triton")(x, residual, weight, eps)
    if cpu_native.handles(x, residual, weight) and x.is_contiguous() and residual.is_contiguous():
        return cpu_native.fused_add_rmsnorm(x, residual, weight, eps)
    return fused_add_rmsnorm_ref(x, residual, weight, eps)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
    cos_cache: torch.Tensor, sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_cuda(q):
        return _triton("rope", "apply_rope_triton")(q, k, positions, cos_cache, sin_cache)
    if (cpu_native.handles(q, k) and _rows_ok(q, k) and cos_cache.dtype == sin_cache.dtype == torch.float32
            and cos_cache.is_contiguous() and sin_cache.is_contiguous()):
        return cpu_native.apply_rope(q, k, positions, cos_cache, sin_cache)
    return apply_rope_ref(q, k, positions, cos_cache, sin_cache)


# ---- the whole decoder stack in one native call ----------------------------

# One layer's weights, as decoder_stack takes them (projections as returned by pack_linear_weight):
#   (input_layernorm, w_qkv, b_qkv | None, w_o, post_attention_layernorm, w_gate_up, w_down)
LayerTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor,
                     torch.Tensor]


def decoder_stack(layers: Sequence[LayerTensors], hidden_size: int, intermediate_size: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, eps: float) -> DecoderStack | None:
    """Every layer in one native call (the engine thread gives up the GIL once
    per step, not once per layer) when every projection was packed for the
    native kernels and the shapes suit them; None elsewhere: run the layers
    op by op.  The tensors must outlive the stack."""
    projections = [w for (_, w_qkv, _, w_o, _, w_gate_up, w_down) in layers for w in (w_qkv, w_o, w_gate_up, w_down)]
    kind = _weight_kind(projections)
    norms = [t for (ln1, _, _, _, ln2, _, _) in layers for t in (ln1, ln2)]
    if kind is None or not (cpu_native.handles(*norms) and head_dim % 32 == 0 and num_heads % num_kv_heads == 0):
        return None
    return DecoderStack([cpu_native.layer_weights(*layer) for layer in layers],
                        hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, eps, kind)


def _weight_kind(projections: list[torch.Tensor]) -> int | None:
    """The stack's ``weight_kind`` when every projection is packed one way (bf16, or int8), else None."""
    if all(w.dim() == 4 and w.dtype == torch.bfloat16 for w in projections):
        return cpu_native.WEIGHT_KINDS["bf16"]
    if all(int8_linear.is_packed_int8(w) for w in projections):
        bits = {int8_linear.packed_bits(w) for w in projections}
        if len(bits) == 1:
            return cpu_native.WEIGHT_KINDS["int8_4bit" if bits == {4} else "int8"]
    return None


def decoder_stack_takes(kv_pool: torch.Tensor) -> bool:
    """Whether a :class:`DecoderStack` can run over ``kv_pool`` (bf16 or 8-bit, on the CPU)."""
    return cpu_native.handles_pool(kv_pool)


def set_native_threads(n: int) -> None:
    """Threads in the native kernels' own work pool (torch's are separate)."""
    cpu_native.set_num_threads(n)


def native_variant() -> str | None:
    """The native CPU kernels in use ("amx_bf16", "avx512_bf16", "avx2"), or None: the torch references run."""
    return cpu_native.loaded_variant()
