"""K smoothing of 8-bit pools (pdcluster/kernels/kv_quant.py): K rows quantized after
subtracting a fixed shift leave attention unchanged up to quantization (and
closer to exact than unshifted rows when K has offset channels), a shift on
only some keys does not, the native writer is bit-exact with the reference,
and plain pools refuse a shift."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import dense_attention, make_paged_case, query_start_loc
from pdcluster.kernels import cpu_native, ops
from pdcluster.kernels.kv_quant import SCALE_BYTES
from pdcluster.kernels.kv_write import write_kv_ref
from pdcluster.kernels.paged_decode_attention import paged_decode_attention_ref
from pdcluster.kernels.prefill_attention import prefill_attention_ref

EIGHT_BIT = [torch.int8, torch.float8_e4m3fn]
LENS = [5, 140, 33]
native = pytest.mark.skipif(not cpu_native.available(), reason="needs AVX-512 BF16 or AVX2+FMA, and a C compiler")


def offset_case(kv_heads: int = 3, head_dim: int = 64):
    """make_paged_case's K with a large constant offset on 6 channels per head
    (as real K has), and that offset as the shift."""
    case = make_paged_case(LENS, kv_heads, head_dim, block_size=16, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    shift = torch.zeros(kv_heads, head_dim)
    channels = torch.randperm(head_dim, generator=gen)[:6]
    shift[:, channels] = (torch.rand(kv_heads, 6, generator=gen) + 1) * 12 * torch.tensor([1.0, -1.0]).repeat(3)
    case.keys = [(k.float() + shift).to(torch.bfloat16) for k in case.keys]
    return case, shift


def write(case, dtype: torch.dtype, shift_of_token, writer=write_kv_ref) -> torch.Tensor:
    """An 8-bit pool holding the case's K/V; token t's K shifted by ``shift_of_token(t)`` (None: not shifted)."""
    shape = (*case.kv_pool.shape[:-1], case.keys[0].shape[-1] + SCALE_BYTES)
    pool = torch.randint(0, 120, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(5)).view(dtype)
    for s, ctx in enumerate(LENS):
        for t in range(ctx):
            slot = torch.tensor([int(case.block_tables[s, t // 16]) * 16 + t % 16])
            writer(pool, case.layer, case.keys[s][t:t + 1], case.values[s][t:t + 1], slot, shift_of_token(t))
    return pool


def worst_error(case, pool: torch.Tensor) -> float:
    """Largest |decode and prefill attention over ``pool`` - dense attention over the case's exact K/V|."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 9, 64, generator=gen).to(torch.bfloat16)
    qp = torch.randn(15, 9, 64, generator=gen).to(torch.bfloat16)
    dec = paged_decode_attention_ref(q, pool, case.layer, case.block_tables, case.context_lens, 0.125)
    pre = prefill_attention_ref(qp, pool, case.layer, case.block_tables, query_start_loc([5, 5, 5]),
                                case.context_lens, 0.125)
    worst = 0.0
    for s, ctx in enumerate(LENS):
        want = dense_attention(q[s:s + 1], case.keys[s], case.values[s], 0.125, torch.tensor([ctx - 1]))
        worst = max(worst, (dec[s:s + 1].double() - want).abs().max().item())
        want = dense_attention(qp[5 * s:5 * s + 5], case.keys[s], case.values[s], 0.125, torch.arange(ctx - 5, ctx))
        worst = max(worst, (pre[5 * s:5 * s + 5].double() - want).abs().max().item())
    return worst


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_shifting_every_key_leaves_attention_unchanged_up_to_quantization(dtype):
    case, shift = offset_case()
    smoothed = worst_error(case, write(case, dtype, lambda t: shift))
    plain = worst_error(case, write(case, dtype, lambda t: None))
    assert smoothed < (0.03 if dtype is torch.int8 else 0.15)
    assert smoothed < plain / 2  # the offset channels no longer set every row's scale


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_a_shift_on_only_some_keys_changes_attention(dtype):
    """q . b is no longer the same for every key: what an unshifted fresh
    chunk over a shifted cached prefix would compute."""
    case, shift = offset_case()
    mixed = worst_error(case, write(case, dtype, lambda t: shift if t < 16 else None))
    assert mixed > 0.2


@native
@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_native_write_of_shifted_k_is_bit_exact_with_the_reference(dtype):
    case, shift = offset_case()
    ref = write(case, dtype, lambda t: shift)
    nat = write(case, dtype, lambda t: shift, writer=cpu_native.write_kv)
    assert torch.equal(nat.view(torch.uint8), ref.view(torch.uint8))
    assert not torch.equal(ref.view(torch.uint8), write(case, dtype, lambda t: None).view(torch.uint8))


def test_plain_pools_and_misshapen_shifts_are_refused():
    k = v = torch.randn(2, 3, 64).bfloat16()
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="8-bit pools only"):
        ops.write_kv(torch.zeros(2, 1, 2, 16, 3, 64, dtype=torch.bfloat16), 0, k, v, slots, torch.zeros(3, 64))
    with pytest.raises(ValueError, match="8-bit pools only"):
        write_kv_ref(torch.zeros(2, 1, 2, 16, 3, 64), 0, k.float(), v.float(), slots, torch.zeros(3, 64))
    if cpu_native.available():
        with pytest.raises(ValueError, match=r"float32 of shape \(3, 64\)"):
            cpu_native.write_kv(torch.zeros(2, 1, 2, 16, 3, 66, dtype=torch.int8), 0, k, v, slots, torch.zeros(64))


@native
def test_unpack_linear_weight_inverts_the_packing():
    w = torch.randn(96, 40).bfloat16()
    packed = ops.pack_linear_weight(w)
    assert packed.dim() == 4
    assert torch.equal(ops.unpack_linear_weight(packed), w)
    assert ops.unpack_linear_weight(w) is w
