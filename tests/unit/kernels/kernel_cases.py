"""Test cases for the kernels: paged KV built from dense K/V, an independent
dense attention, tolerances, and loading the Triton kernels interpreted.

A paged case starts from dense per-sequence K/V and writes them token by
token into a pool whose other slots (other layers, spare blocks, unused
block-table entries) hold random garbage, so a kernel that reads a wrong
slot fails loudly::

    block_tables[s] = [ shuffled block ids of s ... | spare id ]   (non-contiguous)
    token t of s    -> kv_pool[block_tables[s, t // bs], layer, K|V, t % bs]
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

# (atol, rtol) of a Triton kernel against its torch reference.  bf16 is
# loosest also because the CPU interpreter truncates fp32 -> bf16 where a GPU
# rounds to nearest: up to one bf16 ulp (2**-8 relative) per rounding.
ATTENTION_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
ELEMENTWISE_TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1.6e-2)}

TRITON_MODULES = (
    "pdcluster.kernels.triton_common", "pdcluster.kernels.triton_kv8", "pdcluster.kernels.triton_paged_decode_attention", "pdcluster.kernels.triton_prefill_attention",
    "pdcluster.kernels.triton_kv_write", "pdcluster.kernels.triton_block_copy", "pdcluster.kernels.triton_rmsnorm", "pdcluster.kernels.triton_rope",
    "pdcluster.kernels.triton_int8_linear",
)


@dataclass
class PagedCase:
    kv_pool: torch.Tensor         # [num_blocks, layers, 2, bs, kv_heads, d]
    layer: int
    block_tables: torch.Tensor    # [S, max_blocks] int32
    context_lens: torch.Tensor    # [S] int32
    keys: list[torch.Tensor]      # per sequence [ctx, kv_heads, d]
    values: list[torch.Tensor]


def make_paged_case(
    context_lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    num_layers: int = 2, layer: int = 1, seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, num_layers, 2, block_size, kv_heads, head_dim)
    kv_pool = (torch.randn(shape, generator=gen) * 4).to(dtype)  # garbage, larger than real K/V
    ids = torch.randperm(num_blocks, generator=gen)
    spare = int(ids[-1])
    max_blocks = max(blocks_per_seq) + 1  # always at least one ignored trailing entry
    block_tables = torch.full((len(context_lens), max_blocks), spare, dtype=torch.int32)
    keys, values, used = [], [], 0
    for s, ctx in enumerate(context_lens):
        block_tables[s, :blocks_per_seq[s]] = ids[used:used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        keys.append(torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype))
        values.append(torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype))
        for t in range(ctx):
            block = int(block_tables[s, t // block_size])
            kv_pool[block, layer, 0, t % block_size] = keys[s][t]
            kv_pool[block, layer, 1, t % block_size] = values[s][t]
    return PagedCase(kv_pool, layer, block_tables, torch.tensor(context_lens, dtype=torch.int32), keys, values)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_positions: torch.Tensor,
) -> torch.Tensor:
    """Unpaged causal attention in float64.  ``q``: [n, heads, d] at key
    positions ``q_positions``; ``k``, ``v``: [ctx, kv_heads, d]; query head h
    reads kv head ``h // (heads // kv_heads)``.  Returns [n, heads, d] fp64."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), kk) * scale
    visible = torch.arange(k.shape[0])[None, :] <= q_positions[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hnc,chd->nhd", probs, vv)


def query_start_loc(query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)


def interpreted_kernels() -> SimpleNamespace:
    """The Triton modules, guaranteed to run under the CPU interpreter.

    ``@triton.jit`` picks interpreter or compiler when the decorated module is
    imported (it reads ``triton.knobs.runtime.interpret``, i.e.
    ``TRITON_INTERPRET``, at decoration time).  That holds for triton's own
    ``@jit`` library too (``tl.zeros``, ``tl.sum``, ``tl.max`` live in
    ``triton.language.standard``).  tests/conftest.py sets the variable
    before anything imports triton; if triton or our kernel modules were
    imported without it anyway, switch the knob on for this process and
    re-import them (the standard library first, then ours).
    """
    import triton
    from triton.runtime.jit import JITFunction

    triton.knobs.runtime.interpret = True
    if isinstance(triton.language.standard.zeros, JITFunction):
        _reload_triton_stdlib()
    modules = [importlib.import_module(name) for name in TRITON_MODULES]
    if any(isinstance(v, JITFunction) for m in modules for v in vars(m).values()):
        modules = [importlib.reload(m) for m in modules]  # triton_common first: others bind its helpers
    return SimpleNamespace(**{m.__name__.removeprefix("pdcluster.kernels.triton_"): m for m in modules})


def _reload_triton_stdlib() -> None:
    import triton.language as tl
    import triton.language.standard as std

    old = dict(vars(std))
    std = importlib.reload(std)
    for name, value in list(vars(tl).items()):
        if name in old and old[name] is value:
            setattr(tl, name, getattr(std, name))


def run_every_wrapper_once() -> None:
    """Call each Triton wrapper once on small CPU tensors (fp32 and bf16, a
    split and an unsplit decode, and with bf16 the int8 and fp8 pools) —
    what ``aot_compile.py`` records."""
    mods = [importlib.import_module(name) for name in TRITON_MODULES]
    for m in mods:
        m.check_device = lambda *tensors: None  # recording only: nothing is launched
    k = SimpleNamespace(**{m.__name__.removeprefix("pdcluster.kernels.triton_"): m for m in mods})
    for dtype in (torch.float32, torch.bfloat16):
        case = make_paged_case([5, 140], kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
        q = torch.randn(2, 9, 64).to(dtype)
        for splits in (1, 2):
            k.paged_decode_attention.paged_decode_attention_triton(
                q, case.kv_pool, 1, case.block_tables, case.context_lens, 0.125, num_splits=splits)
        qp = torch.randn(10, 9, 64).to(dtype)
        k.prefill_attention.prefill_attention_triton(
            qp, case.kv_pool, 1, case.block_tables, query_start_loc([5, 5]), case.context_lens, 0.125)
        kv = torch.randn(4, 3, 64).to(dtype)
        k.kv_write.write_kv_triton(case.kv_pool, 1, kv, kv, torch.arange(4))
        ids = torch.tensor([1, 0])
        buf = k.block_copy.gather_blocks_triton(case.kv_pool, ids)
        k.block_copy.scatter_blocks_triton(case.kv_pool, ids, buf)
        if dtype is torch.bfloat16:
            _run_kv8_wrappers_once(k, case, q, qp, kv)
        x = torch.randn(3, 576).to(dtype)
        k.rmsnorm.rmsnorm_triton(x, x[0], 1e-5)
        k.rmsnorm.fused_add_rmsnorm_triton(x, x.clone(), x[0], 1e-5)
        cos = torch.randn(32, 64)
        k.rope.apply_rope_triton(qp, qp[:, :3], torch.arange(10), cos, cos)


def _run_kv8_wrappers_once(k: SimpleNamespace, case: PagedCase, q: torch.Tensor, qp: torch.Tensor,
                           kv: torch.Tensor) -> None:
    """The 8-bit pool variants of the KV kernels: int8 and fp8, shifted and
    not, a split decode, prefill with and without a ChunkKV."""
    from pdcluster.kernels.prefill_attention import ChunkKV

    shift = torch.zeros(3, 64)
    for dtype in (torch.int8, torch.float8_e4m3fn):
        pool = torch.zeros((*case.kv_pool.shape[:-1], 66), dtype=torch.uint8).view(dtype)
        k.kv_write.write_kv_triton(pool, 1, kv, kv, torch.arange(4), shift)
        k.kv_write.write_kv_triton(pool, 1, kv, kv, torch.arange(4))
        for splits in (1, 2):
            k.paged_decode_attention.paged_decode_attention_triton(
                q, pool, 1, case.block_tables, case.context_lens, 0.125, num_splits=splits)
        qsl = query_start_loc([5, 5])
        chunk_kv = torch.randn(10, 3, 64).bfloat16()
        for chunk in (None, ChunkKV(chunk_kv, chunk_kv, torch.tensor([1, 0], dtype=torch.int32), shift)):
            k.prefill_attention.prefill_attention_triton(qp, pool, 1, case.block_tables, qsl, case.context_lens,
                                                         0.125, chunk)
        buf = k.block_copy.gather_blocks_triton(pool, torch.tensor([1, 0]))
        k.block_copy.scatter_blocks_triton(pool, torch.tensor([1, 0]), buf)
