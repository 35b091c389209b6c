"""pdcluster/services/engine/model/k_smoothing.py: the calibration forward computes the
K the model itself writes, and the shift is a pure function of the weights
(two loads, packed or not, bf16 or fp32 copies of one set of weights)."""

from __future__ import annotations

import pytest
import torch

from pdcluster.services.engine.forward_batch import ForwardBatch
from pdcluster.services.engine.model.config import ModelConfig
from pdcluster.services.engine.model.k_smoothing import k_shift_from_keys, k_smoothing_shift, post_rope_keys
from pdcluster.services.engine.model.llama import LlamaModel

N = 40
TOKENS = [(11 * p + 5) % 320 for p in range(N)]


def load_tiny(dtype: torch.dtype, pack: bool = True) -> LlamaModel:
    """A fresh 'load' of one fixed set of bf16-representable weights."""
    cfg = ModelConfig(arch="llama", vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
            p.copy_(p.bfloat16().float())
    model = model.to(dtype)
    model.reset_rope()
    if pack:
        model.pack_weights()
    return model


def keys_written_by_the_model(model: LlamaModel) -> torch.Tensor:
    """[layers, N, kv_heads, head_dim]: post-RoPE K as the model's own prefill writes it into a plain fp32 pool."""
    pool = torch.zeros(3, 3, 2, 16, 2, 32)
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=torch.tensor(TOKENS), positions=torch.arange(N), slot_mapping=torch.arange(N),
        num_decode_tokens=0, decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32), prefill_block_tables=table,
        prefill_query_start_loc=torch.tensor([0, N], dtype=torch.int32),
        prefill_context_lens=torch.tensor([N], dtype=torch.int32), logits_indices=torch.tensor([N - 1]),
        prefill_fresh_kv=torch.ones(1, dtype=torch.int32))
    model(batch, pool)
    return pool[:, :, 0].permute(1, 0, 2, 3, 4).reshape(3, -1, 2, 32)[:, :N]


def test_the_calibration_forward_computes_the_models_own_keys():
    model = load_tiny(torch.float32, pack=False)
    want = keys_written_by_the_model(model)
    got = post_rope_keys(model, TOKENS)
    assert got.dtype is torch.float64 and got.shape == (3, N, 2, 32)
    torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)


def test_the_shift_is_each_channels_mean_after_the_first_token_in_bf16():
    keys = torch.randn(2, 9, 3, 8, dtype=torch.float64)
    keys[:, 0] = 1e3  # the first token (attention sink) does not count
    shift = k_shift_from_keys(keys)
    assert shift.dtype is torch.float32 and shift.shape == (2, 3, 8)
    assert torch.equal(shift, keys[:, 1:].mean(1).bfloat16().float())


def test_the_shift_is_a_pure_function_of_the_weights():
    first = k_smoothing_shift(load_tiny(torch.bfloat16), TOKENS)
    assert torch.equal(k_smoothing_shift(load_tiny(torch.bfloat16), TOKENS), first)   # a second load
    assert torch.equal(k_smoothing_shift(load_tiny(torch.bfloat16, pack=False), TOKENS), first)  # unpacked
    assert torch.equal(k_smoothing_shift(load_tiny(torch.float32, pack=False), TOKENS), first)  # fp32 copy
    assert first.abs().max() > 0
    assert not torch.equal(k_smoothing_shift(load_tiny(torch.bfloat16), TOKENS[::-1]), first)


def test_calibration_needs_two_tokens():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        k_smoothing_shift(load_tiny(torch.bfloat16), TOKENS[:1])
