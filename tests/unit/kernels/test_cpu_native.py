"""The native bf16 CPU kernels against their torch references (and decode
attention also against the independent dense attention), plus the dispatch
in ``pdcluster.kernels.ops`` that routes CPU bf16 to them."""

import math

import pytest
import torch
import torch.nn.functional as F

import pdcluster.kernels.ops as ops
from kernel_cases import dense_attention, make_paged_case
from pdcluster.kernels import cpu_native
from pdcluster.kernels.activation import silu_mul_ref
from pdcluster.kernels.kv_write import write_kv_ref
from pdcluster.kernels.paged_decode_attention import paged_decode_attention_ref
from pdcluster.kernels.rmsnorm import fused_add_rmsnorm_ref, rmsnorm_ref
from pdcluster.kernels.rope import apply_rope_ref, rope_cos_sin

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs AVX-512 BF16 or AVX2+FMA, and a C compiler")
BF16 = torch.bfloat16


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8, 9, 17, 300])
@pytest.mark.parametrize("n,k", [(32, 40), (96, 576), (64, 1538)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_fp32_product(rows, n, k, with_bias):
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to(BF16)
    w = torch.randn(n, k, generator=gen).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16) if with_bias else None
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    got = ops.linear(x, ops.pack_linear_weight(w), bias)
    assert got.dtype == BF16 and got.shape == (rows, n)
    # fp32 accumulation, one rounding to bf16: within one bf16 ulp of the exact value
    assert torch.all((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3 * math.sqrt(k))
    ref = F.linear(x, w, bias)  # torch's bf16 linear rounds the same way up to summation order
    assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2**-7


def test_pack_layout_and_what_is_not_packed():
    w = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6).to(BF16)
    packed = cpu_native.pack_weight(w)
    assert packed.shape == (2, 3, 32, 2)
    for j, p, c, e in [(0, 0, 0, 0), (1, 2, 31, 1), (0, 1, 5, 0), (1, 0, 7, 1)]:
        assert packed[j, p, c, e] == w[32 * j + c, 2 * p + e]
    for unpackable in (torch.randn(48, 8).to(BF16), torch.randn(64, 7).to(BF16), torch.randn(64, 8)):
        assert ops.pack_linear_weight(unpackable) is unpackable  # N % 32, odd K, fp32: left for torch


@pytest.mark.parametrize("context_lens", [[1], [17, 5, 33], [300, 1, 64], [40] * 9])
@pytest.mark.parametrize("kv_heads,group", [(1, 1), (3, 3), (2, 4), (2, 8)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (64, 32), (128, 32), (32, 8)])  # the last: general path
def test_decode_attention_matches_reference_and_dense(context_lens, kv_heads, group, head_dim, block_size):
    case = make_paged_case(context_lens, kv_heads, head_dim, block_size, BF16, seed=len(context_lens) + group)
    heads = kv_heads * group
    gen = torch.Generator().manual_seed(7)
    # q as a strided view of a fused qkv row, as the model passes it
    qkv = torch.randn(len(context_lens), (heads + 2 * kv_heads) * head_dim, generator=gen).to(BF16)
    q = qkv[:, :heads * head_dim].view(-1, heads, head_dim)
    scale = head_dim ** -0.5
    got = ops.paged_decode_attention(q, case.kv_pool, case.layer, case.block_tables, case.context_lens, scale)
    ref = paged_decode_attention_ref(q, case.kv_pool, case.layer, case.block_tables, case.context_lens, scale)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    for s, ctx in enumerate(context_lens):
        dense = dense_attention(q[s:s + 1], case.keys[s], case.values[s], scale, torch.tensor([ctx - 1]))
        torch.testing.assert_close(got[s:s + 1].double(), dense, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (5, 100), (40, 64)])
def test_add_rmsnorm_is_bit_exact(tokens, hidden):
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(BF16)
    residual = torch.randn(tokens, hidden, generator=gen).to(BF16)
    weight = torch.randn(hidden, generator=gen).to(BF16)
    r_ref, r_got = residual.clone(), residual.clone()
    out_ref, _ = fused_add_rmsnorm_ref(x, r_ref, weight, 1e-5)
    out_got, r_after = ops.fused_add_rmsnorm(x, r_got, weight, 1e-5)
    assert r_after is r_got and torch.equal(r_got, r_ref)
    assert torch.equal(out_got, out_ref)
    assert torch.equal(ops.rmsnorm(residual, weight, 1e-5), rmsnorm_ref(residual, weight, 1e-5))


@pytest.mark.parametrize("shape", [(1, 6), (7, 3000), (40, 64)])
def test_silu_mul_is_bit_exact(shape):
    gate_up = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 4).to(BF16)
    assert torch.equal(ops.silu_mul(gate_up), silu_mul_ref(gate_up))


@pytest.mark.parametrize("d", [64, 20])  # 20: a half of 10 leaves a tail past the vector width
def test_rope_and_kv_write_on_views_of_fused_qkv(d):
    heads, kv_heads, tokens = 6, 2, 5
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(BF16)
    positions = torch.tensor([0, 1, 15, 16, 511])
    cos, sin = rope_cos_sin(d, 1024, 10000.0)

    def views(t):
        return (t[:, :heads * d].view(tokens, heads, d), t[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d),
                t[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d))

    a, b = qkv.clone(), qkv.clone()
    qa, ka, va = views(a)
    qb, kb, vb = views(b)
    apply_rope_ref(qa, ka, positions, cos, sin)
    ops.apply_rope(qb, kb, positions, cos, sin)
    assert torch.equal(a, b)
    pool_ref = torch.randn(6, 3, 2, 16, kv_heads, d, generator=gen).to(BF16)
    pool_got = pool_ref.clone()
    slots = torch.tensor([5 * 16 + 3, 0, 2 * 16 + 15, 4 * 16, 1 * 16 + 7])
    write_kv_ref(pool_ref, 2, ka, va, slots)
    ops.write_kv(pool_got, 2, kb, vb, slots)
    assert torch.equal(pool_ref, pool_got)



@pytest.mark.parametrize("scale", [0.125, -0.125, 0.0])
def test_prefill_attention_takes_any_scale_and_wide_scores(scale):
    """The softmax subtracts the largest scaled score whatever the scale's sign: with a negative
    scale and scores hundreds apart, subtracting the scaled largest raw score overflowed to NaN."""
    from pdcluster.kernels.prefill_attention import prefill_attention_ref

    case = make_paged_case([301], 3, 64, 16, BF16, seed=3)
    q = (torch.randn(70, 9, 64, generator=torch.Generator().manual_seed(4)) * 30).to(BF16)
    args = (q, case.kv_pool, case.layer, case.block_tables, torch.tensor([0, 70], dtype=torch.int32),
            case.context_lens, scale)
    got = ops.prefill_attention(*args)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), prefill_attention_ref(*args).float(), atol=3e-2, rtol=3e-2)

def test_fp32_and_odd_shapes_stay_on_the_torch_reference():
    x = torch.randn(3, 40)
    w = torch.randn(64, 40)
    assert ops.pack_linear_weight(w) is w
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w))
    assert not cpu_native.handles(x) and cpu_native.handles(x.to(BF16))


@pytest.mark.parametrize("context_lens,query_lens", [
    ([1], [1]), ([5], [5]), ([300], [300]), ([40, 300, 17], [1, 200, 17]), ([1024, 33], [512, 33]), ([70], [3])])
@pytest.mark.parametrize("kv_heads,group", [(1, 1), (3, 3), (2, 8)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_prefill_attention_matches_reference_and_dense(context_lens, query_lens, kv_heads, group, head_dim, block_size):
    from pdcluster.kernels.prefill_attention import prefill_attention_ref

    case = make_paged_case(context_lens, kv_heads, head_dim, block_size, BF16, seed=sum(query_lens) + group)
    heads = kv_heads * group
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(query_lens), 0).tolist()], dtype=torch.int32)
    qkv = torch.randn(int(starts[-1]), (heads + 2 * kv_heads) * head_dim,
                      generator=torch.Generator().manual_seed(5)).to(BF16)
    q = qkv[:, :heads * head_dim].view(-1, heads, head_dim)
    scale = head_dim ** -0.5
    args = (q, case.kv_pool, case.layer, case.block_tables, starts, case.context_lens, scale)
    got = ops.prefill_attention(*args)
    torch.testing.assert_close(got.float(), prefill_attention_ref(*args).float(), atol=3e-2, rtol=3e-2)
    for s, (ctx, q_len) in enumerate(zip(context_lens, query_lens)):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        dense = dense_attention(q[rows], case.keys[s], case.values[s], scale, torch.arange(ctx - q_len, ctx))
        torch.testing.assert_close(got[rows].double(), dense, atol=3e-2, rtol=3e-2)


def test_concurrent_callers_get_correct_results():
    """Two threads running kernels at once (two engines in one process): the
    one that finds the work pool busy runs alone, and both stay exact."""
    import threading

    gen = torch.Generator().manual_seed(11)
    cases = []
    for _ in range(2):
        x = torch.randn(9, 576, generator=gen).to(BF16)
        w = torch.randn(960, 576, generator=gen).to(BF16)
        cases.append((x, ops.pack_linear_weight(w), ops.linear(x, ops.pack_linear_weight(w))))
    errors = []

    def run(x, packed, expected):
        for _ in range(200):
            if not torch.equal(ops.linear(x, packed), expected):
                errors.append("mismatch")
                return

    threads = [threading.Thread(target=run, args=case) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
