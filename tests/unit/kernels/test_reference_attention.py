"""The torch attention references against dense, unpaged causal attention."""

import pytest
import torch

from kernel_cases import dense_attention, make_paged_case, query_start_loc
from pdcluster.kernels.paged_decode_attention import paged_decode_attention_ref
from pdcluster.kernels.prefill_attention import prefill_attention_ref

# Output of the reference (in the input dtype) against the fp64 dense result.
REF_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
SHAPES = [  # (kv_heads, group, head_dim, block_size)
    (2, 1, 64, 16),
    (1, 3, 128, 32),
    (1, 8, 64, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,head_dim,block_size", SHAPES)
def test_decode_reference_matches_dense(kv_heads, group, head_dim, block_size, dtype):
    lens = [1, block_size + 3, 2 * block_size, 3 * block_size + 7]
    case = make_paged_case(lens, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention_ref(q, case.kv_pool, case.layer, case.block_tables, case.context_lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    for s, ctx in enumerate(lens):
        want = dense_attention(q[s:s + 1], case.keys[s], case.values[s], scale, torch.tensor([ctx - 1]))
        atol, rtol = REF_TOL[dtype]
        torch.testing.assert_close(out[s:s + 1].double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,head_dim,block_size", SHAPES)
def test_prefill_reference_matches_dense(kv_heads, group, head_dim, block_size, dtype):
    # (cached prefix, new tokens): first token, whole prompt, chunk after a
    # block-aligned prefix, chunk crossing blocks, a sequence with no new tokens.
    spans = [(0, 1), (0, block_size + 5), (2 * block_size, 4), (block_size + 3, block_size), (7, 0)]
    lens = [p + n for p, n in spans]
    case = make_paged_case(lens, kv_heads, head_dim, block_size, dtype)
    qlens = [n for _, n in spans]
    qsl = query_start_loc(qlens)
    q = torch.randn(int(qsl[-1]), kv_heads * group, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out = prefill_attention_ref(q, case.kv_pool, case.layer, case.block_tables, qsl, case.context_lens, scale)
    for s, (prefix, n) in enumerate(spans):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        want = dense_attention(q[rows], case.keys[s], case.values[s], scale, torch.arange(prefix, prefix + n))
        atol, rtol = REF_TOL[dtype]
        torch.testing.assert_close(out[rows].double(), want, atol=atol, rtol=rtol)


def test_rope_reference_is_a_complex_rotation():
    """Rotate-half RoPE == multiplying (x1 + i*x2) by exp(i * pos * freq)."""
    from pdcluster.kernels.rope import apply_rope_ref, rope_cos_sin
    head_dim, theta = 64, 10000.0
    cos, sin = rope_cos_sin(head_dim, 64, theta)
    q, k = torch.randn(5, 4, head_dim), torch.randn(5, 2, head_dim)
    pos = torch.tensor([0, 1, 17, 17, 63])
    want_q, want_k = (torch.view_as_complex(torch.stack(x.double().split(head_dim // 2, -1), -1).contiguous())
                      for x in (q, k))
    freq = theta ** (-torch.arange(0, head_dim, 2).double() / head_dim)
    turn = torch.polar(torch.ones(5, head_dim // 2, dtype=torch.float64), pos[:, None].double() * freq)[:, None]
    apply_rope_ref(q, k, pos, cos, sin)
    for got, want in ((q, want_q * turn), (k, want_k * turn)):
        torch.testing.assert_close(got.double(), torch.cat([want.real, want.imag], -1), atol=1e-5, rtol=1e-5)


def test_rmsnorm_reference_formula():
    from pdcluster.kernels.rmsnorm import fused_add_rmsnorm_ref
    x, residual, weight = torch.randn(4, 96), torch.randn(4, 96), torch.randn(96)
    total = (x + residual).double()
    want = total / total.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * weight.double()
    out, res = fused_add_rmsnorm_ref(x, residual, weight, 1e-6)
    assert res is residual
    torch.testing.assert_close(res.double(), total)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
