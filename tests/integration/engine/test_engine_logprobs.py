"""Logprobs on the real model (fp32): sampled tokens' and prompt tokens'
equal Hugging Face transformers' log-softmax within 1e-3, through chunked
prefill and in a batch with requests that did not ask; prompt logprobs skip
the prefix cache; every KV block comes back."""

from __future__ import annotations

import pytest
import torch

from pdcluster.services.sampling_params import SamplingParams
from tests.integration.engine.conftest import (
    _hf_model,
    divergence_from_transformers,
    hf_next_token_logprobs,
    make_engine,
)

TOL = 1e-3
MAX_NEW = 6


@pytest.fixture(scope="module")
def prompt(smol_fp32) -> list[int]:
    return smol_fp32.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")


def _hf_prompt_logprobs(prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = _hf_model(torch.float32)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)   # row p scores token p+1


def test_greedy_logprobs_and_top_logprobs_equal_transformers(smol_fp32, prompt):
    eos = smol_fp32.tokenizer.eos_token_ids
    engine = make_engine(smol_fp32, num_kv_blocks=64)
    out = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=5))[0]
    assert divergence_from_transformers(torch.float32, prompt, out.new_token_ids, MAX_NEW, eos) is None
    ref_logprobs = hf_next_token_logprobs(torch.float32, prompt, out.new_token_ids)
    assert len(out.logprobs) == len(out.new_token_ids)
    for entry, ref in zip(out.logprobs, ref_logprobs):
        assert entry.logprob == pytest.approx(ref[entry.token_id].item(), abs=TOL)
        assert entry.top[0][0] == entry.token_id                    # greedy: the chosen token is the likeliest
        values, ids = torch.topk(ref, 5)
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=TOL)
        assert [i for i, _ in entry.top][:2] == ids.tolist()[:2]
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


@pytest.mark.parametrize("chunk", [8, 512])
def test_prompt_logprobs_equal_transformers_through_chunked_prefill(smol_fp32, prompt, chunk):
    engine = make_engine(smol_fp32, num_kv_blocks=64, prefill_chunk_size=chunk, max_num_batched_tokens=max(chunk, 16))
    asks = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2, logprobs=0)
    plain = SamplingParams(max_tokens=2, temperature=0)
    both = engine.generate([prompt, prompt[:-3]], [asks, plain])
    out, other = both
    ref = _hf_prompt_logprobs(prompt)
    assert [e.token_id for e in out.prompt_logprobs] == prompt[1:]
    for j, e in enumerate(out.prompt_logprobs):
        assert e.logprob == pytest.approx(ref[j, prompt[j + 1]].item(), abs=TOL)
        assert [v for _, v in e.top] == pytest.approx(torch.topk(ref[j], 2).values.tolist(), abs=TOL)
    assert other.prompt_logprobs is None and other.logprobs is None   # a request that did not ask pays nothing
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_prompt_logprobs_are_computed_even_when_the_prompt_is_cached(smol_fp32, prompt):
    engine = make_engine(smol_fp32, num_kv_blocks=64)
    long_prompt = prompt * 3   # several full blocks, cached after the first run
    engine.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0))
    out = engine.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(long_prompt) - 1
    again = engine.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    assert again.num_cached_tokens > 0   # its blocks still went into the prefix cache
    engine.check_integrity()
