"""Prompt chunks over an 8-bit pool attend to their own K/V as computed
(pdcluster/kernels/prefill_attention.py ChunkKV): only the cached prefix is read
through quantization, its K with the shift added back; a verification
(fresh 0) still reads the pool; the native kernel agrees with the reference
and, for a chunk with no prefix, is exactly the bf16 pool's attention."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import dense_attention, query_start_loc
from pdcluster.kernels import cpu_native, ops
from pdcluster.kernels.prefill_attention import ChunkKV, prefill_attention_ref
from test_k_smoothing_kernels import LENS, offset_case, write

EIGHT_BIT = [torch.int8, torch.float8_e4m3fn]
Q_LENS = [5, 20, 33]  # the last sequence is all chunk (no cached prefix)
native = pytest.mark.skipif(not cpu_native.available(), reason="needs AVX-512 BF16 or AVX2+FMA, and a C compiler")


def chunk_case(dtype: torch.dtype):
    """offset_case (K with large offset channels, the offset as shift) in an
    8-bit pool, every K row written shifted; the queries' own K/V beside them."""
    case, shift = offset_case()
    pool = write(case, dtype, lambda t: shift)
    q = torch.randn(sum(Q_LENS), 9, 64, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    k = torch.cat([case.keys[s][ctx - n:] for s, (ctx, n) in enumerate(zip(LENS, Q_LENS))])
    v = torch.cat([case.values[s][ctx - n:] for s, (ctx, n) in enumerate(zip(LENS, Q_LENS))])
    return case, shift, pool, q, k, v


def attend(fn, case, pool, q, chunk):
    return fn(q, pool, case.layer, case.block_tables, query_start_loc(Q_LENS), case.context_lens, 0.125, chunk)


def plain_pool(case) -> torch.Tensor:
    """The case's bf16 pool holding its keys as offset_case made them (make_paged_case wrote them before)."""
    plain = case.kv_pool.clone()
    for s, ctx in enumerate(LENS):
        for t in range(ctx):
            plain[int(case.block_tables[s, t // 16]), case.layer, 0, t % 16] = case.keys[s][t]
    return plain


def worst_vs_dense(case, q, got) -> float:
    worst, start = 0.0, 0
    for s, (ctx, n) in enumerate(zip(LENS, Q_LENS)):
        want = dense_attention(q[start:start + n], case.keys[s], case.values[s], 0.125, torch.arange(ctx - n, ctx))
        worst = max(worst, (got[start:start + n].double() - want).abs().max().item())
        start += n
    return worst


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_a_prompt_chunk_is_closer_to_exact_attending_to_its_own_kv(dtype):
    case, shift, pool, q, k, v = chunk_case(dtype)
    fresh = ChunkKV(k, v, torch.ones(3, dtype=torch.int32), shift)
    through_pool = worst_vs_dense(case, q, attend(prefill_attention_ref, case, pool, q, None))
    own = worst_vs_dense(case, q, attend(prefill_attention_ref, case, pool, q, fresh))
    assert own < (0.02 if dtype is torch.int8 else 0.1)
    assert own < through_pool * 0.8


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_the_prefix_keys_get_the_pools_shift_back_and_no_other(dtype):
    """The chunk's K is unshifted, the pool's is shifted: attention is right
    only when the prefix gets exactly that shift back."""
    case, shift, pool, q, k, v = chunk_case(dtype)
    ones = torch.ones(3, dtype=torch.int32)
    right = worst_vs_dense(case, q, attend(prefill_attention_ref, case, pool, q, ChunkKV(k, v, ones, shift)))
    for wrong in (None, shift * 0.5, shift.flip(0)):
        mixed = worst_vs_dense(case, q, attend(prefill_attention_ref, case, pool, q, ChunkKV(k, v, ones, wrong)))
        assert mixed > 0.2 > 5 * right


def test_a_chunk_with_no_prefix_is_exactly_attention_over_its_own_kv():
    """Sequence 2 is all chunk: what a plain pool of q's dtype holding the same K/V computes, bit for bit."""
    case, shift, pool, q, k, v = chunk_case(torch.int8)
    got = attend(prefill_attention_ref, case, pool, q, ChunkKV(k, v, torch.ones(3, dtype=torch.int32), shift))
    want = attend(prefill_attention_ref, case, plain_pool(case), q, None)
    assert torch.equal(got[25:], want[25:])


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_a_verification_reads_the_pool_as_decode_does(dtype):
    case, shift, pool, q, k, v = chunk_case(dtype)
    mixed = attend(prefill_attention_ref, case, pool, q, ChunkKV(k, v, torch.tensor([0, 1, 0], dtype=torch.int32),
                                                                  shift))
    want = attend(prefill_attention_ref, case, pool, q, None)
    assert torch.equal(mixed[:5], want[:5]) and torch.equal(mixed[25:], want[25:])
    assert not torch.equal(mixed[5:25], want[5:25])


def test_chunk_kv_is_refused_where_it_does_not_fit():
    case, shift, pool, q, k, v = chunk_case(torch.int8)
    ones = torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="8-bit pools only"):
        attend(ops.prefill_attention, case, case.kv_pool, q, ChunkKV(k, v, ones, shift))
    with pytest.raises(ValueError, match="beside q"):
        attend(ops.prefill_attention, case, pool, q, ChunkKV(k[1:], v[1:], ones, shift))
    with pytest.raises(ValueError, match="one flag per sequence"):
        attend(ops.prefill_attention, case, pool, q, ChunkKV(k, v, ones[:2], shift))
    with pytest.raises(ValueError, match="float32 of shape"):
        attend(ops.prefill_attention, case, pool, q, ChunkKV(k, v, ones, shift[0]))


@native
@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_native_prompt_chunks_match_the_reference(dtype):
    case, shift, pool, q, k, v = chunk_case(dtype)
    for flags in ([1, 1, 1], [0, 1, 0]):
        chunk = ChunkKV(k, v, torch.tensor(flags, dtype=torch.int32), shift)
        torch.testing.assert_close(attend(cpu_native.prefill_attention, case, pool, q, chunk),
                                   attend(prefill_attention_ref, case, pool, q, chunk), atol=2e-2, rtol=2e-2)
    wrong = ChunkKV(k, v, torch.ones(3, dtype=torch.int32), None)
    assert worst_vs_dense(case, q, attend(cpu_native.prefill_attention, case, pool, q, wrong)) > 0.2


@native
def test_native_chunk_rows_strided_like_the_models_qkv_view():
    """k and v as views into one [T, q | k | v] row (the model passes these)."""
    case, shift, pool, q, k, v = chunk_case(torch.int8)
    qkv = torch.cat([q.reshape(len(q), -1), k.reshape(len(q), -1), v.reshape(len(q), -1)], dim=1)
    qv, kv_, vv = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=1)
    views = [t.reshape(len(q), -1, 64) for t in (qv, kv_, vv)]
    ones = torch.ones(3, dtype=torch.int32)
    got = attend(cpu_native.prefill_attention, case, pool, views[0], ChunkKV(views[1], views[2], ones, shift))
    want = attend(cpu_native.prefill_attention, case, pool, q, ChunkKV(k, v, ones, shift))
    assert torch.equal(got, want)


@native
def test_native_chunk_with_no_prefix_is_exactly_the_bf16_pools_attention():
    case, shift, pool, q, k, v = chunk_case(torch.int8)
    got = attend(cpu_native.prefill_attention, case, pool, q, ChunkKV(k, v, torch.ones(3, dtype=torch.int32), shift))
    want = attend(cpu_native.prefill_attention, case, plain_pool(case), q, None)
    assert torch.equal(got[25:], want[25:])
