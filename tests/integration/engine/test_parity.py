"""Greedy output equals Hugging Face transformers token for token."""

from __future__ import annotations

import pytest
import torch

from pdcluster.services.sampling_params import greedy
from tests.integration.engine.conftest import (
    _hf_model,
    divergence_from_transformers,
    hf_greedy,
    make_engine,
    run_staggered,
)

MAX_NEW = 64
NEAR_TIE_NATS = 0.3  # bf16: a divergence is acceptable only where HF's top-2 log-probs are this close


def _assert_fp32_equals_transformers(loaded, prompts, ours, case: str) -> None:
    eos = loaded.tokenizer.eos_token_ids
    for i, prompt in enumerate(prompts):
        diverged = divergence_from_transformers(torch.float32, prompt, ours[i], MAX_NEW, eos)
        assert diverged is None, f"prompt {i} ({len(prompt)} tokens, {case}) diverges: {diverged}"


def test_teacher_forced_check_agrees_with_transformers_generate(smol_fp32, parity_prompts):
    """The checks below ask transformers for one teacher-forced forward pass
    per prompt; on a short prompt, that verdict and transformers' own
    `generate` agree: its greedy tokens pass, and any one changed token fails."""
    prompt, eos = parity_prompts[0], smol_fp32.tokenizer.eos_token_ids
    theirs = hf_greedy(_hf_model(torch.float32), prompt, 24, eos)
    assert divergence_from_transformers(torch.float32, prompt, theirs, 24, eos) is None
    changed = theirs[:10] + [(theirs[10] + 1) % smol_fp32.config.vocab_size] + theirs[11:]
    assert divergence_from_transformers(torch.float32, prompt, changed, 24, eos).position == 10
    assert divergence_from_transformers(torch.float32, prompt, theirs[:20], 24, eos).position == 20


def test_fp32_continuous_batch_equals_transformers(smol_fp32, parity_prompts):
    engine = make_engine(smol_fp32)
    ours = run_staggered(engine, parity_prompts, greedy(MAX_NEW))
    _assert_fp32_equals_transformers(smol_fp32, parity_prompts, ours, "continuous batch")


@pytest.mark.parametrize("case", ["preemption", "chunked32"])
def test_fp32_small_pool_and_chunking_equal_transformers(smol_fp32, parity_prompts, case):
    if case == "preemption":
        # 8 prompts need ~190 blocks at their longest; 72 blocks force preemption.
        engine = make_engine(smol_fp32, num_kv_blocks=72, max_num_batched_tokens=256, prefill_chunk_size=128)
    else:
        engine = make_engine(smol_fp32, prefill_chunk_size=32, max_num_batched_tokens=96)
    ours = run_staggered(engine, parity_prompts, greedy(MAX_NEW), every_steps=1)
    if case == "preemption":
        assert engine.scheduler.num_preemptions > 0
    _assert_fp32_equals_transformers(smol_fp32, parity_prompts, ours, case)


def test_bf16_diverges_only_at_near_ties(smol_bf16, parity_prompts):
    eos = smol_bf16.tokenizer.eos_token_ids
    engine = make_engine(smol_bf16)
    ours = run_staggered(engine, parity_prompts, greedy(MAX_NEW))
    for i, prompt in enumerate(parity_prompts):
        diverged = divergence_from_transformers(torch.bfloat16, prompt, ours[i], MAX_NEW, eos)
        if diverged is not None:
            assert diverged.margin < NEAR_TIE_NATS, f"prompt {i} diverges where HF is sure: {diverged}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_random_safetensors_models_equal_transformers(tmp_path, smol_fp32, arch):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from pdcluster.services.engine.model.loader import load_model

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
