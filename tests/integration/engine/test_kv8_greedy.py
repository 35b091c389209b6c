"""The real model over an 8-bit KV cache: the prompt's prefill is bf16 KV's
up to the K rotation's rounding (and the same for every 8-bit format),
greedy output parts from bf16 KV's only at near ties, and every block
comes back.

Why not "identical on 14 of 16 prompts" (issue 23's wording): with bf16
weights SmolLM2's logits are bf16, 0.125 apart near the top, so exact and
one-step ties are common, and any rounding change flips some of them. bf16
KV read by the reference attention instead of the native kernels (the same
KV bytes, another summation order) is identical on only 8 of the 16 chat
prompts of bench/micro/levers_kv.py; int8 KV on 5, with every divergence at a
top-2 gap of at most 0.125 nats (K-rotated int8: 6, at most 0.25).  So the test holds int8 KV to the standard
test_parity.py holds bf16 to against transformers; bench/micro/levers_kv.py
prints the 16-prompt count.  fp8 e4m3 keeps 3 mantissa bits (about 2.5 %
error per value against int8's 0.4 % of the row's largest): on the 16
prompts it parts at gaps up to 0.625 nats, so its bound is looser."""

from __future__ import annotations

import pytest

from pdcluster.services.engine.config import EngineConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.sampling_params import SamplingParams
from tests.integration.engine.hand_off import decode_all, prefill_and_pull
from tests.integration.engine.test_parity import NEAR_TIE_NATS

QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.",
             "How do I reverse a list in Python?", "Why is the sky blue?")
MAX_NEW = 32
DIVERGENCE_NATS = {"int8": NEAR_TIE_NATS, "fp8_e4m3": 1.0}  # widest baseline top-2 gap a divergence may flip
# the rotation's bf16 rounding moves the first token's top logprobs 0.004-0.07 with the AVX-512 and AVX2 kernels;
# with the AMX kernels' summation order it moves one prompt's second logit by one bf16 step (0.117 nats; logits
# near the top are bf16, 0.125 apart): the bound is one such step
PREFILL_ROTATION_NATS = 0.13


def run(loaded, kv_cache_dtype: str):
    engine = Engine(EngineConfig(kv_cache_dtype=kv_cache_dtype, num_kv_blocks=128), loaded=loaded)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=2))
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks  # no KV leaks
    assert all(o.error is None for o in outs)
    return engine, outs


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_kv_diverges_from_bf16_kv_only_at_near_ties(smol_bf16, kv_cache_dtype):
    base_engine, base = run(smol_bf16, "bf16")
    engine, ours = run(smol_bf16, kv_cache_dtype)
    assert engine.hash_seed != base_engine.hash_seed  # 8-bit and bf16 blocks never share a prefix-cache entry
    assert engine.kv_spec.block_bytes / base_engine.kv_spec.block_bytes <= 0.55
    for i, (b, o) in enumerate(zip(base, ours)):
        # the prompt's own prefill attends to its K/V as computed, never quantized (pdcluster/kernels/prefill_attention.py),
        # but over an 8-bit pool q and K are Hadamard-rotated first and rounded to bf16 again
        # (pdcluster/kernels/kv_rotation.py): the first token's distribution is bf16 KV's to that rounding
        gaps = [abs(x[1] - y[1]) for x, y in zip(b.logprobs[0].top, o.logprobs[0].top)]
        assert max(gaps) < PREFILL_ROTATION_NATS, f"prompt {i}: prefill over {kv_cache_dtype} KV moved {gaps}"
        diff = next((j for j, (x, y) in enumerate(zip(b.new_token_ids, o.new_token_ids)) if x != y), None)
        if diff is None:
            assert len(b.new_token_ids) == len(o.new_token_ids)
            continue
        top = b.logprobs[diff].top
        margin = top[0][1] - top[1][1]
        assert margin < DIVERGENCE_NATS[kv_cache_dtype], \
            f"prompt {i} diverges at {diff} where bf16 KV's margin is {margin:.3f} nats"


def test_the_prefill_over_any_8bit_pool_is_the_same_bit_for_bit(smol_bf16):
    """Quantization never reaches the prompt's own prefill: int8 and fp8
    pools (both rotated) give the same first-token distribution."""
    (_, int8), (_, fp8) = run(smol_bf16, "int8"), run(smol_bf16, "fp8_e4m3")
    assert [o.logprobs[0].top for o in int8] == [o.logprobs[0].top for o in fp8]


def test_int8_prefill_hand_off_over_a_real_pull_equals_one_engine(smol_bf16):
    """Prefill on one int8 engine, the blocks pulled (socket backend, scales
    inside them) into another, decode there: the tokens of one engine, and
    the pull's byte count is the int8 layout's, about half of bf16's."""
    prefill, decode, whole = (Engine(EngineConfig(kv_cache_dtype="int8", num_kv_blocks=64), loaded=smol_bf16)
                              for _ in range(3))
    prompt = prefill.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[2] + " Be brief."}])
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = whole.generate([prompt], params)[0].new_token_ids
    first, num_bytes, num_blocks = prefill_and_pull(prefill, decode, [("r", prompt, params)])
    assert num_bytes == num_blocks * prefill.kv_spec.block_bytes > 0
    assert decode_all(decode, first)["r"] == want
    for engine in (prefill, decode, whole):
        engine.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
