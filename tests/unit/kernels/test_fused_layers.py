"""The fused-layer path (one native call per decoder layer) computes exactly
what the per-op path computes, on a mixed step of decode tokens and prefill
chunks over paged KV, with and without qkv bias."""

import pytest
import torch

from pdcluster.kernels import cpu_native
from pdcluster.services.engine.forward_batch import ForwardBatch
from pdcluster.services.engine.model.config import ModelConfig
from pdcluster.services.engine.model.llama import LlamaModel

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs AVX-512 BF16 or AVX2+FMA, and a C compiler")
BS = 16


def tiny_model(bias: bool, tied: bool = True, pack: bool = True) -> LlamaModel:
    """A 3-layer bf16 model of random weights (seed 0), packed for the native kernels unless ``pack`` is False."""
    cfg = ModelConfig(arch="qwen2" if bias else "llama", vocab_size=320, hidden_size=128, intermediate_size=256,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, attention_bias=bias,
                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model = model.to(torch.bfloat16)
    model.reset_rope()
    if pack:
        model.pack_weights()
    return model


def mixed_batch() -> ForwardBatch:
    """Two decode tokens (contexts 20 and 33) then two prefill chunks (a fresh
    prompt of 9 and 7 new tokens after 25 cached ones)."""
    tables = {0: [3, 7], 1: [1, 9, 4], 2: [6], 3: [2, 8]}
    ctx = {0: 20, 1: 33, 2: 9, 3: 32}
    new = {0: 1, 1: 1, 2: 9, 3: 7}
    ids, pos, slots = [], [], []
    for s in range(4):
        for p in range(ctx[s] - new[s], ctx[s]):
            ids.append((7 * p + s) % 320)
            pos.append(p)
            slots.append(tables[s][p // BS] * BS + p % BS)

    def table(rows):
        width = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)

    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
        num_decode_tokens=2, decode_block_tables=table([tables[0], tables[1]]),
        decode_context_lens=torch.tensor([20, 33], dtype=torch.int32),
        prefill_block_tables=table([tables[2], tables[3]]),
        prefill_query_start_loc=torch.tensor([0, 9, 16], dtype=torch.int32),
        prefill_context_lens=torch.tensor([9, 32], dtype=torch.int32),
        logits_indices=torch.tensor([0, 1, 10, 17]), prefill_fresh_kv=torch.ones(2, dtype=torch.int32))


@pytest.mark.parametrize("bias", [False, True])
def test_fused_stack_equals_per_op_path(bias):
    model = tiny_model(bias)
    assert model.native_stack is not None
    gen = torch.Generator().manual_seed(1)
    pool = (torch.randn(10, 3, 2, BS, 2, 32, generator=gen) * 0.5).to(torch.bfloat16)  # earlier tokens' KV
    batch = mixed_batch()
    pool_fused, pool_ops = pool.clone(), pool.clone()
    fused = model(batch, pool_fused)
    stack, model.native_stack = model.native_stack, None
    per_op = model(batch, pool_ops)
    model.native_stack = stack
    assert torch.equal(pool_fused, pool_ops)
    assert torch.equal(fused, per_op)
    assert fused.shape == (4, 320) and torch.isfinite(fused).all()
