"""logprobs, echo and n > 1 end to end through the official openai client.

Written against the ``cluster`` and ``client`` fixtures only, so the same
tests run on the disaggregated session cluster here and on the colocated
one (tests/integration/colocated imports them).  In disaggregated mode the
first token is sampled on the prefill replica: its logprobs travel in the
hand-off, and the streamed and whole answers must agree token for token."""

from __future__ import annotations

import time
import uuid

import openai
import pytest
import torch

from tests.integration.cluster.conftest import board
from tests.integration.cluster.test_cluster_api import MODEL, wait_no_leaks

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_NEW = 5
# The engine's own numbers: the replica's decode steps against one whole-sequence prefill here.
SAME_ENGINE_TOL = {"float32": 1e-3, "bfloat16": 0.1}
HF_FP32_TOL = 1e-3


def _reference_engine(cluster):
    """An offline engine like the cluster's replicas (same model, dtype, one thread)."""
    from pdcluster.services.engine.config import EngineConfig
    from pdcluster.services.engine.engine import Engine

    return Engine(EngineConfig(num_kv_blocks=64, dtype=cluster.config.dtype, num_threads=1))


def _log_softmax_along(engine, token_ids: list[int], from_position: int) -> list:
    """The engine's log-softmax at each position >= ``from_position`` of
    ``token_ids``, from one prefill of the whole sequence (prompt logprobs)."""
    from pdcluster.services.sampling_params import SamplingParams

    out = engine.generate([token_ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5))[0]
    return out.prompt_logprobs[from_position - 1:]


def test_greedy_top_logprobs_equal_the_engines_own_log_softmax(cluster, client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_NEW, temperature=0,
                                          logprobs=True, top_logprobs=5)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens and all(len(c.top_logprobs) == 5 for c in content)
    engine = _reference_engine(cluster)
    prompt = engine.tokenizer.apply_chat_template(MESSAGES)
    offline = engine.generate([prompt], _greedy_with_logprobs())[0]
    assert [c.token for c in content] == [engine.tokenizer.decode([t], skip_special_tokens=False)
                                          for t in offline.new_token_ids]
    tol = SAME_ENGINE_TOL[cluster.config.dtype]
    whole = _log_softmax_along(engine, prompt + offline.new_token_ids[:-1], len(prompt))
    for c, mine, ref in zip(content, offline.logprobs, whole):
        assert c.logprob == pytest.approx(mine.logprob, abs=tol)
        assert c.logprob == pytest.approx(ref.logprob, abs=tol)
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([lp for _, lp in mine.top], abs=tol)
    if cluster.config.dtype == "float32":
        _assert_equal_to_transformers(prompt, offline.new_token_ids, [c.logprob for c in content])
    wait_no_leaks(cluster)


def _greedy_with_logprobs():
    from pdcluster.services.sampling_params import SamplingParams

    return SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=5)


def _assert_equal_to_transformers(prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
    from tests.integration.engine.conftest import _hf_model

    with torch.inference_mode():
        logits = _hf_model(torch.float32)(torch.tensor([prompt + tokens])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        assert lp == pytest.approx(ref[len(prompt) - 1 + i, t].item(), abs=HF_FP32_TOL)


def test_streamed_logprobs_equal_the_whole_answers(cluster, client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=MAX_NEW, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for chunk in client.chat.completions.create(**kw, stream=True)
                for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]
    wait_no_leaks(cluster)


def test_echo_scores_the_prompt_like_lm_eval(cluster, client):
    prompt = "The capital of France is Paris"
    scored = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0,
                                       temperature=0)
    choice = scored.choices[0]
    engine = _reference_engine(cluster)
    ids = engine.tokenizer.encode(prompt)
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    ref = _log_softmax_along(engine, ids, 1)
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in ref], abs=SAME_ENGINE_TOL[cluster.config.dtype])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    one = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=1, temperature=0)
    assert one.choices[0].text.startswith(prompt) and len(one.choices[0].logprobs.tokens) == len(ids) + 1
    one_lp = one.choices[0].logprobs.token_logprobs
    assert one_lp[0] is None and one_lp[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    wait_no_leaks(cluster)


def _prompt_tokens_cached(cluster) -> int:
    time.sleep(0.6)   # > one status period: the board is fresh
    return sum(s["prompt_tokens_cached"] for s in board(cluster) if s["role"] in ("prefill", "colocated"))


def test_n3_returns_three_choices_that_share_the_prompts_blocks(cluster, client):
    # A prompt no earlier test sent: choice 0 computes it, choices 1 and 2 find its full blocks cached.
    prompt = f"Request {uuid.uuid4().hex}: write three words about the sea, the sky and the mountains."
    num_prompt = len(_reference_engine(cluster).tokenizer.encode(prompt))
    full_blocks_tokens = (num_prompt - 1) // cluster.config.block_size * cluster.config.block_size
    assert full_blocks_tokens >= cluster.config.block_size
    before = _prompt_tokens_cached(cluster)
    resp = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=8, temperature=1.5, seed=11,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.prompt_tokens == num_prompt and resp.usage.completion_tokens == 3 * 8
    assert resp.usage.prompt_tokens_details.cached_tokens == full_blocks_tokens
    assert _prompt_tokens_cached(cluster) - before >= 2 * full_blocks_tokens
    assert len({c.text for c in resp.choices}) > 1   # each choice has its own random stream
    again = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=8, temperature=1.5, seed=11,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]   # seed i derives from (seed, i)
    wait_no_leaks(cluster)


def test_n_streamed_chunks_carry_their_choice_index(cluster, client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and texts[0] == texts[1]   # greedy: the same answer twice
    assert chunks[-1].usage.completion_tokens == 2 * 4
    wait_no_leaks(cluster)


@pytest.mark.parametrize("kw, param", [(dict(logprobs=True, top_logprobs=21), "top_logprobs"),
                                       (dict(top_logprobs=2), "top_logprobs"), (dict(n=17), "n")])
def test_out_of_range_is_a_400_naming_the_field(cluster, client, kw, param):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kw)
    assert bad.value.body["param"] == param
