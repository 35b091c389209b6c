"""Triton kernels over 8-bit KV pools (CPU interpreter) against the torch
references: the writer bit-exact (same bytes, scales included), attention
within a stated tolerance, block copies byte for byte, and the dispatch that
sends 8-bit pools on CUDA to them.

SmolLM2's shape throughout (9 query heads over 3 kv heads, head_dim 64,
block_size 16); K written shifted by a K-smoothing vector, as the engine
writes every 8-bit pool.

Tolerances (``assert_close``: |got - want| <= atol + rtol * |want|):

- decode computes as the reference does, in fp32 over values dequantized in
  registers (``code * scale``, exact in fp32): only the summation order and
  exp2 vs exp differ (~1e-7), then the output is rounded to q's dtype.  fp32
  q: (2e-6, 2e-5).  bf16 q: one bf16 ulp of the output, 2**-7 relative (the
  interpreter truncates fp32 -> bf16 where torch rounds to nearest).
- prefill rounds each dequantized key and value to q's dtype, as the
  reference does, then runs the plain kernel's math: the plain kernels'
  tolerance (``ATTENTION_TOL``; bf16: where each side rounds the softmax
  weights to bf16 differs).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_cases import ATTENTION_TOL, make_paged_case, query_start_loc
from pdcluster.kernels import ops
from pdcluster.kernels.block_copy import gather_blocks_ref
from pdcluster.kernels.kv_quant import SCALE_BYTES
from pdcluster.kernels.kv_write import write_kv_ref
from pdcluster.kernels.paged_decode_attention import paged_decode_attention_ref
from pdcluster.kernels.prefill_attention import ChunkKV, prefill_attention_ref
from test_kv8_chunk_kv import Q_LENS, chunk_case, worst_vs_dense

EIGHT_BIT = [torch.int8, torch.float8_e4m3fn]
IDS = ["int8", "fp8"]
DECODE_TOL = {torch.float32: (2e-6, 2e-5), torch.bfloat16: (1e-5, 2 ** -7)}
LENS = [1, 16 + 5, 32, 150]  # one token; a partial last block; two whole blocks; several BLOCK_N tiles


def garbage_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bytes (finite codes and scales): rows a wrong read would pick up."""
    return torch.randint(0, 120, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5)).view(dtype)


def shifted_case(dtype: torch.dtype, lens: list[int], largest: float = 10.0):
    """make_paged_case's K/V (rows scaled by 1e-3 .. ``largest``, so every row
    has its own scale) written by the reference, K shifted, into an 8-bit pool."""
    case = make_paged_case(lens, 3, 64, 16, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    spread = lambda x: (x.float() * torch.logspace(-3, math.log10(largest), x.shape[0])[torch.randperm(x.shape[0], generator=gen),
                                                                      None, None]).bfloat16()
    case.keys, case.values = [spread(k) for k in case.keys], [spread(v) for v in case.values]
    shift = torch.randn(3, 64, generator=gen) * 2
    pool = garbage_pool((*case.kv_pool.shape[:-1], 64 + SCALE_BYTES), dtype)
    for s, ctx in enumerate(lens):
        slots = torch.tensor([int(case.block_tables[s, t // 16]) * 16 + t % 16 for t in range(ctx)])
        write_kv_ref(pool, case.layer, case.keys[s], case.values[s], slots, shift)
    return case, pool, shift


def bytes_of(pool: torch.Tensor) -> torch.Tensor:
    return pool.view(torch.uint8)


# ---- the writer: the reference's bytes -------------------------------------

@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=IDS)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32], ids=["bf16-kv", "fp32-kv"])
def test_write_is_bit_exact_with_the_reference(tk, dtype, kv_dtype):
    """Rows of every magnitude (scales 1e-6 .. 1e3), an all-zero row, a -0.0,
    K shifted and not, slots scattered over blocks and layer 1 of 2."""
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(12, 3, 64, generator=gen) * torch.logspace(-6, 3, 12)[:, None, None]).to(kv_dtype)
    v = (torch.randn(12, 3, 64, generator=gen) * torch.logspace(3, -6, 12)[:, None, None]).to(kv_dtype)
    k[0, 1], v[3, 2], k[2, 0, 5] = 0.0, 0.0, -0.0
    slots = torch.randperm(5 * 16, generator=gen)[:12]
    shift = torch.randn(3, 64, generator=gen)
    for k_shift in (shift, None):
        want, got = garbage_pool((5, 2, 2, 16, 3, 66), dtype), garbage_pool((5, 2, 2, 16, 3, 66), dtype)
        write_kv_ref(want, 1, k, v, slots, k_shift)
        tk.kv_write.write_kv_triton(got, 1, k, v, slots, k_shift)
        assert torch.equal(bytes_of(got), bytes_of(want))
    shifted = garbage_pool((5, 2, 2, 16, 3, 66), dtype)
    tk.kv_write.write_kv_triton(shifted, 1, k, v, slots, shift)
    assert not torch.equal(bytes_of(shifted), bytes_of(got))  # the shift reaches the bytes


@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=IDS)
def test_write_rounds_every_code_and_tie_as_torch(tk, dtype):
    """Rows whose amax is QMAX (scale exactly 1) holding every code, the
    midpoints between neighbours (ties: to the even code) and points just
    beside them: the encoding itself, bit for bit."""
    qmax = 127.0 if dtype is torch.int8 else 448.0
    if dtype is torch.int8:
        codes = torch.arange(0, 128).float()
    else:
        codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    values = torch.cat([codes, mids, mids * (1 + 2 ** -7), mids * (1 - 2 ** -7)])
    values = torch.cat([values, -values])
    values = values[: values.numel() // 64 * 64].view(-1, 1, 64)
    values[:, 0, 0] = qmax
    slots = torch.arange(values.shape[0])
    want = torch.zeros(values.shape[0], 1, 2, 1, 1, 66, dtype=dtype)
    got = torch.zeros_like(want)
    write_kv_ref(want, 0, values, values, slots)
    tk.kv_write.write_kv_triton(got, 0, values, values, slots)
    assert torch.equal(bytes_of(got), bytes_of(want))


def test_write_skips_padding_slots_and_refuses_misfits(tk):
    pool = garbage_pool((2, 1, 2, 16, 3, 66), torch.int8)
    before = pool.clone()
    k = torch.randn(2, 3, 64).bfloat16()
    tk.kv_write.write_kv_triton(pool, 0, k, k, torch.tensor([-1, -1]))
    assert torch.equal(bytes_of(pool), bytes_of(before))
    with pytest.raises(ValueError, match=r"float32 of shape \(3, 64\)"):
        tk.kv_write.write_kv_triton(pool, 0, k, k, torch.tensor([0, 1]), torch.zeros(64))
    with pytest.raises(ValueError, match="head_dim \\+ 2 wide"):
        tk.kv_write.write_kv_triton(pool, 0, k[..., :32], k[..., :32], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="8-bit pools only"):
        tk.kv_write.write_kv_triton(torch.zeros(2, 1, 2, 16, 3, 64), 0, k, k, torch.tensor([0, 1]),
                                    torch.zeros(3, 64))


# ---- decode: every key read through its scale, shifted as stored -----------

@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=IDS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=["bf16-q", "fp32-q"])
def test_decode_matches_the_reference(tk, dtype, q_dtype):
    case, pool, _ = shifted_case(dtype, LENS)
    q = torch.randn(len(LENS), 9, 64, generator=torch.Generator().manual_seed(4)).to(q_dtype)
    args = (q, pool, case.layer, case.block_tables, case.context_lens, 0.125)
    want = paged_decode_attention_ref(*args)
    atol, rtol = DECODE_TOL[q_dtype]
    for num_splits in (1, 3):
        got = tk.paged_decode_attention.paged_decode_attention_triton(*args, num_splits=num_splits)
        assert got.dtype == q_dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    # The case catches a kernel that ignored the scales: read at scale 1, the answer is far off.
    unscaled = pool.clone()
    bytes_of(unscaled)[..., 64:] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)  # bf16 1.0, little-endian
    assert (paged_decode_attention_ref(q, unscaled, *args[2:]).float() - got.float()).abs().max() > 0.1


# ---- prefill: the cached prefix through the pool, a prompt chunk's own K/V --

@pytest.mark.parametrize("dtype", EIGHT_BIT, ids=IDS)
def test_prefill_matches_the_reference(tk, dtype):
    """chunk_case: prefixes 0, 120 (a partial block) and 0; prompt chunks
    (fresh 1) and a verification (fresh 0) in one batch, then no ChunkKV."""
    case, shift, pool, q, k, v = chunk_case(dtype)
    qsl = query_start_loc(Q_LENS)
    atol, rtol = ATTENTION_TOL[torch.bfloat16]
    for chunk in (ChunkKV(k, v, torch.tensor([1, 0, 1], dtype=torch.int32), shift), None):
        args = (q, pool, case.layer, case.block_tables, qsl, case.context_lens, 0.125, chunk)
        got = tk.prefill_attention.prefill_attention_triton(*args)
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), prefill_attention_ref(*args).float(), atol=atol, rtol=rtol)


def test_prefill_in_fp32_matches_the_reference_closely(tk):
    """fp32 q, chunk K/V as the views of one fused qkv row the model passes."""
    case, shift, pool, q, k, v = chunk_case(torch.int8)
    qkv = torch.cat([t.float().reshape(len(q), -1) for t in (q, k, v)], dim=1)
    qv, kv, vv = (t.reshape(len(q), -1, 64) for t in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=1))
    chunk = ChunkKV(kv, vv, torch.ones(3, dtype=torch.int32), shift)
    args = (qv, pool, case.layer, case.block_tables, query_start_loc(Q_LENS), case.context_lens, 0.125, chunk)
    atol, rtol = ATTENTION_TOL[torch.float32]
    torch.testing.assert_close(tk.prefill_attention.prefill_attention_triton(*args), prefill_attention_ref(*args),
                               atol=atol, rtol=rtol)


def test_prefill_gives_the_prefix_keys_the_pools_shift_back(tk):
    """Right only with exactly the pool's shift added to the prefix keys
    (offset_case's K has large offset channels: a wrong shift is far off)."""
    case, shift, pool, q, k, v = chunk_case(torch.int8)
    ones = torch.ones(3, dtype=torch.int32)

    def worst(k_shift):
        got = tk.prefill_attention.prefill_attention_triton(
            q, pool, case.layer, case.block_tables, query_start_loc(Q_LENS), case.context_lens, 0.125,
            ChunkKV(k, v, ones, k_shift))
        return worst_vs_dense(case, q, got)

    right = worst(shift)
    assert right < 0.02
    for wrong in (None, shift * 0.5):
        assert worst(wrong) > 0.2 > 5 * right


def test_prefill_of_one_token_and_a_chunk_inside_a_block(tk):
    """A one-token prompt (context 1) and a 3-token chunk after a 19-token
    prefix (it starts and ends inside the second block), fresh, fp8.  Rows
    at most unit-sized: the reference rounds the dequantized keys to bf16
    where the interpreter truncates them, which larger scores would amplify."""
    lens, q_lens = [1, 22], [1, 3]
    case, pool, shift = shifted_case(torch.float8_e4m3fn, lens, largest=1.0)
    k = torch.cat([case.keys[0], case.keys[1][-3:]])
    v = torch.cat([case.values[0], case.values[1][-3:]])
    q = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    chunk = ChunkKV(k, v, torch.ones(2, dtype=torch.int32), shift)
    args = (q, pool, case.layer, case.block_tables, query_start_loc(q_lens), case.context_lens, 0.125, chunk)
    atol, rtol = ATTENTION_TOL[torch.bfloat16]
    torch.testing.assert_close(tk.prefill_attention.prefill_attention_triton(*args).float(),
                               prefill_attention_ref(*args).float(), atol=atol, rtol=rtol)


# ---- block copies: raw rows, byte for byte ---------------------------------

def test_block_copies_move_8bit_rows_byte_for_byte(tk):
    """fp8 bytes that are NaN codes (0x7f, 0xff) or -0 (0x80) as e4m3 (a
    scale's low byte can be any of them) survive gather and scatter."""
    pool = garbage_pool((6, 2, 2, 16, 3, 66), torch.float8_e4m3fn)
    bytes_of(pool)[2, 0, 0, 0, 0, :4] = torch.tensor([0x7F, 0xFF, 0x80, 0xFE], dtype=torch.uint8)
    ids = torch.tensor([2, 4])
    buffer = tk.block_copy.gather_blocks_triton(pool, ids)
    assert buffer.dtype == pool.dtype and torch.equal(bytes_of(buffer), bytes_of(gather_blocks_ref(pool, ids)))
    tk.block_copy.scatter_blocks_triton(pool, torch.tensor([0, 5]), buffer)
    assert torch.equal(bytes_of(pool[0]), bytes_of(pool[2])) and torch.equal(bytes_of(pool[5]), bytes_of(pool[4]))
    tk.block_copy.scatter_blocks_triton(pool, torch.tensor([1]), bytes_of(buffer[1:]))  # a uint8 buffer too
    assert torch.equal(bytes_of(pool[1]), bytes_of(pool[4]))
    with pytest.raises(ValueError, match="raw bytes"):
        tk.block_copy.scatter_blocks_triton(pool, torch.tensor([1]), buffer[1:].float())


# ---- dispatch: 8-bit pools on CUDA go to these kernels ----------------------

def test_ops_send_8bit_pools_on_cuda_to_the_triton_kernels(tk, monkeypatch):
    """With pdcluster.kernels.ops believing the tensors are on CUDA, every KV op over
    an 8-bit pool runs the (interpreted) Triton kernel with its k_shift and
    ChunkKV: the writer's bytes are the reference's, attention is close."""
    calls: list[str] = []

    def traced(module: str, name: str):
        calls.append(name)
        return getattr(tk, module).__dict__[name]

    monkeypatch.setattr(ops, "_on_cuda", lambda t: True)
    monkeypatch.setattr(ops, "_triton", traced)
    case, shift, pool, q, k, v = chunk_case(torch.int8)
    slots = torch.tensor([int(case.block_tables[1, 8]) * 16 + 9, int(case.block_tables[0, 0]) * 16 + 2])
    want = pool.clone()
    write_kv_ref(want, case.layer, k[:2], v[:2], slots, shift)
    ops.write_kv(pool, case.layer, k[:2], v[:2], slots, shift)
    assert torch.equal(bytes_of(pool), bytes_of(want))
    args = (q[:3], pool, case.layer, case.block_tables, case.context_lens, 0.125)
    torch.testing.assert_close(ops.paged_decode_attention(*args).float(), paged_decode_attention_ref(*args).float(),
                               atol=DECODE_TOL[torch.bfloat16][0], rtol=DECODE_TOL[torch.bfloat16][1])
    chunk = ChunkKV(k, v, torch.ones(3, dtype=torch.int32), shift)
    args = (q, pool, case.layer, case.block_tables, query_start_loc(Q_LENS), case.context_lens, 0.125, chunk)
    atol, rtol = ATTENTION_TOL[torch.bfloat16]
    torch.testing.assert_close(ops.prefill_attention(*args).float(), prefill_attention_ref(*args).float(),
                               atol=atol, rtol=rtol)
    assert calls == ["write_kv_triton", "paged_decode_attention_triton", "prefill_attention_triton"]
