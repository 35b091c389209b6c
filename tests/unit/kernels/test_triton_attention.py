"""Triton attention kernels (CPU interpreter) against the torch references."""

import pytest
import torch

from kernel_cases import ATTENTION_TOL, make_paged_case, query_start_loc
from pdcluster.kernels.paged_decode_attention import paged_decode_attention_ref
from pdcluster.kernels.prefill_attention import prefill_attention_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
SHAPES = [  # (kv_heads, group, head_dim, block_size): GQA 1/3/8, d 64/128, bs 16/32
    (2, 1, 64, 16),
    (1, 3, 128, 32),
    (1, 8, 64, 32),
    (2, 3, 64, 16),
    (1, 8, 128, 16),
]


def _close(got, want, dtype):
    atol, rtol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kv_heads,group,head_dim,block_size", SHAPES)
def test_decode_matches_reference(tk, kv_heads, group, head_dim, block_size, dtype):
    # context 1, not a multiple of the block size, an exact multiple, long
    # enough for several splits and several BLOCK_N steps per split.
    lens = [1, block_size + 3, 2 * block_size, 150]
    case = make_paged_case(lens, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim).to(dtype)
    args = (q, case.kv_pool, case.layer, case.block_tables, case.context_lens, head_dim ** -0.5)
    want = paged_decode_attention_ref(*args)
    decode = tk.paged_decode_attention.paged_decode_attention_triton
    for num_splits in (1, 3):
        got = decode(*args, num_splits=num_splits)
        assert got.dtype == dtype and got.shape == q.shape
        _close(got, want, dtype)


def test_decode_default_split_heuristic_and_strided_q(tk):
    """Heuristic split count, q a strided view of a fused qkv buffer."""
    case = make_paged_case([300, 7], kv_heads=3, head_dim=64, block_size=16, dtype=torch.float16)
    qkv = torch.randn(2, (9 + 6) * 64).half()
    q = qkv[:, :9 * 64].view(2, 9, 64)
    args = (q, case.kv_pool, case.layer, case.block_tables, case.context_lens, 0.125)
    _close(tk.paged_decode_attention.paged_decode_attention_triton(*args),
           paged_decode_attention_ref(*args), torch.float16)


# The interpreter is slowest here: every dtype on the first shape, one dtype
# on each other shape (all GQA ratios, head dims and block sizes covered).
PREFILL_CASES = [(*SHAPES[0], dtype) for dtype in DTYPES] + [
    (*SHAPES[1], torch.bfloat16), (*SHAPES[2], torch.float16), (*SHAPES[3], torch.float32),
    (*SHAPES[4], torch.bfloat16),
]


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,dtype", PREFILL_CASES,
                         ids=[f"{k}-{g}-{d}-{b}-{DTYPE_IDS[DTYPES.index(t)]}" for k, g, d, b, t in PREFILL_CASES])
def test_prefill_matches_reference(tk, kv_heads, group, head_dim, block_size, dtype):
    # (cached prefix, new tokens): one-token prompt; a prompt of more than one
    # BLOCK_M tile; a chunk after a block-aligned prefix; a chunk crossing
    # blocks after an unaligned prefix; a sequence with no new tokens.
    spans = [(0, 1), (0, 70), (2 * block_size, 5), (block_size + 3, block_size), (9, 0)]
    case = make_paged_case([p + n for p, n in spans], kv_heads, head_dim, block_size, dtype)
    qsl = query_start_loc([n for _, n in spans])
    q = torch.randn(int(qsl[-1]), kv_heads * group, head_dim).to(dtype)
    args = (q, case.kv_pool, case.layer, case.block_tables, qsl, case.context_lens, head_dim ** -0.5)
    got = tk.prefill_attention.prefill_attention_triton(*args)
    assert got.dtype == dtype and got.shape == q.shape
    _close(got, prefill_attention_ref(*args), dtype)


def test_prefill_with_max_query_len_given(tk):
    case = make_paged_case([20, 3], kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    qsl = query_start_loc([4, 3])
    q = torch.randn(7, 3, 64)
    args = (q, case.kv_pool, case.layer, case.block_tables, qsl, case.context_lens, 0.125)
    got = tk.prefill_attention.prefill_attention_triton(*args, max_query_len=4)
    _close(got, prefill_attention_ref(*args), torch.float32)
