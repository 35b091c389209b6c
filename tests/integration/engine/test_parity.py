"""Greedy output equals Hugging Face transformers token for token."""

from __future__ import annotations

import pytest
import torch

from services.engine.sampling_params import greedy
from tests.integration.engine.conftest import make_engine, run_staggered

MAX_NEW = 64
NEAR_TIE_NATS = 0.3  # bf16: a divergence is acceptable only where HF's top-2 log-probs are this close


def _hf_tokens(hf_reference, dtype, prompts, eos):
    return [hf_reference(dtype, p, MAX_NEW, eos) for p in prompts]


def test_fp32_continuous_batch_equals_transformers(smol_fp32, parity_prompts, hf_reference):
    eos = smol_fp32.tokenizer.eos_token_ids
    engine = make_engine(smol_fp32)
    ours = run_staggered(engine, parity_prompts, greedy(MAX_NEW))
    for i, (ref, _) in enumerate(_hf_tokens(hf_reference, torch.float32, parity_prompts, eos)):
        assert ours[i] == ref, f"prompt {i} ({len(parity_prompts[i])} tokens) diverges"


@pytest.mark.parametrize("case", ["preemption", "chunked32"])
def test_fp32_small_pool_and_chunking_equal_transformers(smol_fp32, parity_prompts, hf_reference, case):
    eos = smol_fp32.tokenizer.eos_token_ids
    if case == "preemption":
        # 8 prompts need ~190 blocks at their longest; 72 blocks force preemption.
        engine = make_engine(smol_fp32, num_kv_blocks=72, max_num_batched_tokens=256, prefill_chunk_size=128)
    else:
        engine = make_engine(smol_fp32, prefill_chunk_size=32, max_num_batched_tokens=96)
    ours = run_staggered(engine, parity_prompts, greedy(MAX_NEW), every_steps=1)
    if case == "preemption":
        assert engine.scheduler.num_preemptions > 0
    for i, (ref, _) in enumerate(_hf_tokens(hf_reference, torch.float32, parity_prompts, eos)):
        assert ours[i] == ref, f"prompt {i} diverges ({case})"


def test_bf16_diverges_only_at_near_ties(smol_bf16, parity_prompts, hf_reference):
    eos = smol_bf16.tokenizer.eos_token_ids
    engine = make_engine(smol_bf16)
    ours = run_staggered(engine, parity_prompts, greedy(MAX_NEW))
    for i, (ref, logprobs) in enumerate(_hf_tokens(hf_reference, torch.bfloat16, parity_prompts, eos)):
        mine = ours[i]
        diff = next((j for j, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        if diff is None:
            assert len(mine) == len(ref), f"prompt {i}: same tokens but different lengths"
            continue
        top2 = torch.topk(logprobs[diff], 2).values
        margin = float(top2[0] - top2[1])
        assert margin < NEAR_TIE_NATS, f"prompt {i} diverges at {diff} where HF's margin is {margin:.3f} nats"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_random_safetensors_models_equal_transformers(tmp_path, smol_fp32, arch):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from services.engine.model.loader import load_model

    torch.manual_seed(0)
    common = dict(vocab_size=smol_fp32.config.vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.5, eos_token_id=2, bos_token_id=1)
    cfg = LlamaConfig(**common, tie_word_embeddings=False) if arch == "llama" else Qwen2Config(**common, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    smol_fp32.tokenizer.hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), "float32")
    assert loaded.config.arch == arch and loaded.config.attention_bias == (arch == "qwen2")
    engine = make_engine(loaded, num_kv_blocks=64)
    prompts = [[5, 17, 300, 41, 9], list(range(100, 180)), [7] * 33]
    ours = run_staggered(engine, prompts, greedy(24, ignore_eos=True), every_steps=2)
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
        assert ours[i] == ref, f"{arch} prompt {i}"
