"""8-bit KV rows (pdcluster/kernels/kv_quant.py): the format, the torch references over
it, the native kernels bit-exact or close to them, and the dispatch that never
hands 8-bit rows to a kernel that reads plain values."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import dense_attention, make_paged_case, query_start_loc
from pdcluster.kernels import cpu_native, ops
from pdcluster.kernels.kv_quant import SCALE_BYTES, dequantize_rows, pool_dtype, pool_head_dim, quantize_rows, row_width
from pdcluster.kernels.kv_write import write_kv_ref
from pdcluster.kernels.paged_decode_attention import paged_decode_attention_ref
from pdcluster.kernels.prefill_attention import prefill_attention_ref
from pdcluster.transfer.layout import EIGHT_BIT_SCALE_BYTES

EIGHT_BIT = [torch.int8, torch.float8_e4m3fn]
# worst relative error of one value against its row's amax: half a step of 254 (int8);
# e4m3 keeps 3 mantissa bits, so half an ulp (1/16) of the value itself
ROUND_TRIP_TOL = {torch.int8: 0.5 / 127 + 1e-3, torch.float8_e4m3fn: 1 / 16 + 1e-3}
native = pytest.mark.skipif(not cpu_native.available(), reason="needs AVX-512 BF16 or AVX2+FMA, and a C compiler")


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_round_trip_is_within_half_a_step_and_scales_sit_after_the_payload(dtype):
    x = (torch.randn(7, 3, 64) * torch.logspace(-3, 2, 7)[:, None, None]).to(torch.bfloat16)
    rows = quantize_rows(x, dtype)
    assert rows.shape == (7, 3, 64 + SCALE_BYTES) and rows.dtype == dtype
    amax = x.float().abs().amax(-1, keepdim=True)
    err = (dequantize_rows(rows) - x.float()).abs()
    assert (err <= ROUND_TRIP_TOL[dtype] * amax).all()
    scale = rows.view(torch.uint8)[..., 64:].contiguous().view(torch.bfloat16).float()
    assert torch.allclose(scale, (amax / (127 if dtype is torch.int8 else 448)).bfloat16().float())


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_zero_rows_and_extremes_stay_finite(dtype):
    x = torch.zeros(2, 64)
    x[1, 0], x[1, 1] = 3e38, -1e-30
    back = dequantize_rows(quantize_rows(x, dtype))
    assert torch.isfinite(back).all() and back[0].abs().max() == 0
    assert back[1, 0] == pytest.approx(3e38, rel=0.01)


def test_format_constants_agree_across_layers():
    assert EIGHT_BIT_SCALE_BYTES == SCALE_BYTES  # pdcluster/transfer/layout.py cannot import kernels
    assert row_width(64, torch.int8) == 66 and row_width(64, torch.bfloat16) == 64
    assert pool_dtype("auto", torch.float32) is torch.float32 and pool_dtype("int8", torch.bfloat16) is torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        pool_dtype("int4", torch.bfloat16)


def quantized_case(dtype: torch.dtype, context_lens: list[int], writer=write_kv_ref, kv_heads: int = 3,
                   head_dim: int = 64):
    """make_paged_case's K/V written by ``writer`` into an 8-bit pool (unused
    slots hold random bytes: garbage rows a wrong read would pick up)."""
    case = make_paged_case(context_lens, kv_heads, head_dim, block_size=16, dtype=torch.bfloat16)
    shape = (*case.kv_pool.shape[:-1], head_dim + SCALE_BYTES)
    gen = torch.Generator().manual_seed(5)
    pool = torch.randint(0, 120, shape, dtype=torch.uint8, generator=gen).view(dtype)  # finite codes and scales
    for s, ctx in enumerate(context_lens):
        slots = torch.tensor([int(case.block_tables[s, t // 16]) * 16 + t % 16 for t in range(ctx)])
        writer(pool, case.layer, case.keys[s], case.values[s], slots)
    return case, pool


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_reference_attention_over_8bit_kv_is_close_to_dense(dtype):
    case, pool = quantized_case(dtype, [5, 140, 33])
    assert pool_head_dim(pool) == 64
    tol = 0.03 if dtype is torch.int8 else 0.15
    q = torch.randn(3, 9, 64).to(torch.bfloat16)
    got = paged_decode_attention_ref(q, pool, case.layer, case.block_tables, case.context_lens, 0.125)
    for s, ctx in enumerate(case.context_lens.tolist()):
        want = dense_attention(q[s:s + 1], case.keys[s], case.values[s], 0.125, torch.tensor([ctx - 1]))
        torch.testing.assert_close(got[s:s + 1].double(), want, atol=tol, rtol=tol)
    qp = torch.randn(15, 9, 64).to(torch.bfloat16)
    got = prefill_attention_ref(qp, pool, case.layer, case.block_tables, query_start_loc([5, 5, 5]),
                                case.context_lens, 0.125)
    for s, ctx in enumerate(case.context_lens.tolist()):
        want = dense_attention(qp[5 * s:5 * s + 5], case.keys[s], case.values[s], 0.125, torch.arange(ctx - 5, ctx))
        torch.testing.assert_close(got[5 * s:5 * s + 5].double(), want, atol=tol, rtol=tol)


@native
@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_native_write_is_bit_exact_and_attention_matches_the_reference(dtype):
    case, ref_pool = quantized_case(dtype, [5, 140, 33])
    _, nat_pool = quantized_case(dtype, [5, 140, 33], writer=cpu_native.write_kv)
    assert torch.equal(nat_pool.view(torch.uint8), ref_pool.view(torch.uint8))
    q = torch.randn(3, 9, 64).to(torch.bfloat16)
    args = (ref_pool, case.layer, case.block_tables, case.context_lens, 0.125)
    torch.testing.assert_close(cpu_native.paged_decode_attention(q, *args), paged_decode_attention_ref(q, *args),
                               atol=2e-2, rtol=2e-2)
    qp = torch.randn(15, 9, 64).to(torch.bfloat16)
    args = (ref_pool, case.layer, case.block_tables, query_start_loc([5, 5, 5]), case.context_lens, 0.125)
    torch.testing.assert_close(cpu_native.prefill_attention(qp, *args), prefill_attention_ref(qp, *args),
                               atol=2e-2, rtol=2e-2)


@native
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 2, 96), (2, 2, 32)])
def test_native_decode_over_int8_kv_for_every_group_size(heads, kv_heads, head_dim):
    """GQA groups of 4 (3 + 1 query heads per pass), 2 and 1; 96 and 32 columns."""
    case, pool = quantized_case(torch.int8, [1, 9, 70], kv_heads=kv_heads, head_dim=head_dim)
    q = torch.randn(3, heads, head_dim).to(torch.bfloat16)
    args = (pool, case.layer, case.block_tables, case.context_lens, head_dim ** -0.5)
    torch.testing.assert_close(cpu_native.paged_decode_attention(q, *args), paged_decode_attention_ref(q, *args),
                               atol=2e-2, rtol=2e-2)


@native
def test_native_fp8_encoding_is_torchs_on_every_code_and_tie():
    """Every e4m3 value, the midpoints between neighbours (ties go to the even
    code) and points just beside them, through both writers."""
    codes = torch.arange(0, 0x7f, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    values = torch.cat([codes, mids, mids * (1 + 2**-7), mids * (1 - 2**-7)])
    values = torch.cat([values, -values])
    values = values[: values.numel() // 64 * 64].view(-1, 1, 64)
    values[:, 0, 0] = 448.0  # every row's amax is 448, so its scale is exactly 1
    pools = [torch.zeros(values.shape[0], 1, 2, 1, 1, 66, dtype=torch.float8_e4m3fn) for _ in range(2)]
    slots = torch.arange(values.shape[0])
    write_kv_ref(pools[0], 0, values.bfloat16().float(), values.bfloat16().float(), slots)
    cpu_native.write_kv(pools[1], 0, values.bfloat16(), values.bfloat16(), slots)
    assert torch.equal(pools[0].view(torch.uint8), pools[1].view(torch.uint8))


def test_ops_route_8bit_pools_to_kernels_that_read_them(monkeypatch):
    """With the native kernels off, 8-bit pools go to the references (never a
    bf16 kernel); with them on, the result is the same."""
    case, pool = quantized_case(torch.int8, [20, 37])
    q = torch.randn(2, 9, 64).to(torch.bfloat16)
    args = (pool, case.layer, case.block_tables, case.context_lens, 0.125)
    want = paged_decode_attention_ref(q, *args)
    if cpu_native.available():
        torch.testing.assert_close(ops.paged_decode_attention(q, *args), want, atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    assert torch.equal(ops.paged_decode_attention(q, *args), want)
    k, v = torch.randn(2, 2, 3, 64).bfloat16().unbind(0)
    slots = torch.tensor([3, 40])
    ops.write_kv(pool, 0, k, v, slots)
    back = dequantize_rows(pool[2, 0, 0, 8])  # slot 40: block 2, offset 8
    torch.testing.assert_close(back, k[1].float(), atol=0.03, rtol=0.02)
