"""KV write, block gather/scatter, RMSNorm and RoPE Triton kernels (CPU
interpreter) against the torch references."""

import pytest
import torch

from kernel_cases import ELEMENTWISE_TOL, make_paged_case
from pdcluster.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
from pdcluster.kernels.kv_write import write_kv_ref
from pdcluster.kernels.rmsnorm import fused_add_rmsnorm_ref, rmsnorm_ref
from pdcluster.kernels.rope import apply_rope_ref, rope_cos_sin

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def _close(got, want, dtype, atol_scale=1.0):
    atol, rtol = ELEMENTWISE_TOL[dtype]
    atol *= atol_scale
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_heads,head_dim,block_size", [(1, 64, 16), (3, 128, 32)])
def test_write_kv_matches_reference(tk, kv_heads, head_dim, block_size, dtype):
    case = make_paged_case([block_size + 5, 3], kv_heads, head_dim, block_size, dtype)
    # Slots in shuffled blocks, one not block-aligned run; k/v are strided
    # views of a fused buffer, in another dtype than the pool.
    slots = torch.tensor([int(case.block_tables[0, 1]) * block_size + 4,
                          int(case.block_tables[1, 0]) * block_size,
                          int(case.block_tables[0, 0]) * block_size + block_size - 1])
    kv = torch.randn(3, 3 * kv_heads * head_dim, dtype=torch.float32)
    k = kv[:, :kv_heads * head_dim].view(3, kv_heads, head_dim)
    v = kv[:, 2 * kv_heads * head_dim:].view(3, kv_heads, head_dim)
    want = case.kv_pool.clone()
    write_kv_ref(want, case.layer, k, v, slots)
    tk.kv_write.write_kv_triton(case.kv_pool, case.layer, k, v, slots)
    _close(case.kv_pool, want, dtype)


def test_write_kv_skips_padding_slots(tk):
    case = make_paged_case([4], 2, 64, 16, torch.float16)
    before = case.kv_pool.clone()
    k = torch.randn(2, 2, 64).half()
    tk.kv_write.write_kv_triton(case.kv_pool, case.layer, k, k, torch.tensor([-1, -1]))
    assert torch.equal(case.kv_pool, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather_scatter_match_reference(tk, dtype):
    case = make_paged_case([40, 9], 3, 64, 16, dtype)
    ids = torch.tensor([4, 0, 2])
    got = tk.block_copy.gather_blocks_triton(case.kv_pool, ids)
    assert got.is_contiguous()
    assert torch.equal(got, gather_blocks_ref(case.kv_pool, ids))
    buffer = torch.randn(got.shape)  # fp32 into the pool's dtype
    want = case.kv_pool.clone()
    scatter_blocks_ref(want, ids, buffer)
    tk.block_copy.scatter_blocks_triton(case.kv_pool, ids, buffer)
    _close(case.kv_pool, want, dtype)
    roundtrip = tk.block_copy.gather_blocks_triton(case.kv_pool, ids)
    tk.block_copy.scatter_blocks_triton(case.kv_pool, torch.tensor([1, 3, 5]), roundtrip)
    assert torch.equal(case.kv_pool[torch.tensor([1, 3, 5])], roundtrip)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [96, 576])
def test_rmsnorm_matches_reference(tk, hidden, dtype):
    x = torch.randn(5, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    _close(tk.rmsnorm.rmsnorm_triton(x, weight, 1e-5), rmsnorm_ref(x, weight, 1e-5), dtype)
    residual = torch.randn(5, hidden).to(dtype)
    want_res = residual.clone()
    want, _ = fused_add_rmsnorm_ref(x, want_res, weight, 1e-5)
    got, got_res = tk.rmsnorm.fused_add_rmsnorm_triton(x, residual, weight, 1e-5)
    assert got_res is residual
    _close(residual, want_res, dtype)
    _close(got, want, dtype)


def test_rmsnorm_keeps_torch_type_promotion(tk):
    """fp32 weight on bf16 activations gives fp32, as in the reference."""
    x, weight = torch.randn(2, 3, 64).bfloat16(), torch.randn(64)
    got, want = tk.rmsnorm.rmsnorm_triton(x, weight, 1e-6), rmsnorm_ref(x, weight, 1e-6)
    assert got.dtype == want.dtype == torch.float32 and got.shape == x.shape
    _close(got, want, torch.bfloat16)
    x_t = torch.randn(64, 5).t()  # hidden dim not unit-stride: copied, not refused
    _close(tk.rmsnorm.rmsnorm_triton(x_t, weight, 1e-6), rmsnorm_ref(x_t, weight, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 128)])
def test_rope_matches_reference(tk, heads, kv_heads, head_dim, dtype):
    cos, sin = rope_cos_sin(head_dim, 128, 100000.0)
    qkv = torch.randn(6, (heads + 2 * kv_heads) * head_dim).to(dtype)  # q, k: strided views
    q = qkv[:, :heads * head_dim].view(6, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(6, kv_heads, head_dim)
    pos = torch.tensor([0, 1, 127, 40, 40, 3])
    want_q, want_k = apply_rope_ref(q.clone(), k.clone(), pos, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    got_q, got_k = tk.rope.apply_rope_triton(q, k, pos, cos, sin)
    assert got_q is q and got_k is k
    # Each output is a difference of two rounded products of size |x|, so its
    # error is absolute (an ulp of |x| <= 4 per rounding), not relative.
    _close(q, want_q, dtype, atol_scale=4.0)
    _close(k, want_k, dtype, atol_scale=4.0)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched
