"""Logprob computation (pdcluster/services/engine/logprobs.py) against torch.log_softmax,
no model: sampled tokens' logprobs, per-row k, isolation from in-place
logit edits, and prompt logprobs assembled chunk by chunk."""

from __future__ import annotations

import pytest
import torch

from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.engine.logprobs import SampledLogprobs, prompt_span, record_prompt_logprobs, token_logprobs
from pdcluster.services.engine.request import Request
from pdcluster.services.engine.sampler import Sampler
from pdcluster.services.sampling_params import MAX_LOGPROBS, SamplingParams

VOCAB = 64


def test_token_logprobs_equal_log_softmax_with_each_rows_own_k():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 4
    tokens, ks = [5, 17, 63], [0, 3, 20]
    got = token_logprobs(logits, tokens, ks)
    ref = torch.log_softmax(logits, dim=-1)
    for row, (entry, t, k) in enumerate(zip(got, tokens, ks)):
        assert entry.token_id == t
        assert entry.logprob == pytest.approx(ref[row, t].item(), abs=1e-6)
        assert len(entry.top) == k
        values, ids = torch.topk(ref[row], k)
        assert [i for i, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-6)


def test_sampled_logprobs_are_of_the_raw_logits_whatever_the_sampler_does_after():
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    raw = logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2),
              SamplingParams(temperature=0, logprobs=5, logit_bias={3: 100.0}), SamplingParams(temperature=0)]
    ids = ["a", "b", "c", "d"]
    asked = SampledLogprobs.of(logits, ids, params)
    logits.mul_(0.0)   # an in-place mask or penalty after the snapshot cannot reach it
    scored = asked.score({"a": 1, "b": 2, "c": 3, "d": 4})
    assert set(scored) == {"b", "c"}
    ref = torch.log_softmax(raw, dim=-1)
    assert scored["b"].logprob == pytest.approx(ref[1, 2].item(), abs=1e-6) and len(scored["b"].top) == 2
    assert scored["c"].logprob == pytest.approx(ref[2, 3].item(), abs=1e-6)   # before logit_bias
    assert asked.score({"b": 2}).keys() == {"b"}                              # a failed row has no token


def test_a_batch_without_logprobs_pays_nothing():
    assert SampledLogprobs.of(torch.randn(2, VOCAB), ["a", "b"], [SamplingParams(), SamplingParams()]) is None
    result = Sampler().sample_batch(torch.randn(2, VOCAB), ["a", "b"], [SamplingParams(temperature=0)] * 2)
    assert result.logprobs == {} and result.prompt_logprobs == {}


def _request(prompt: list[int], k: int | None) -> Request:
    return Request("r", prompt, SamplingParams(max_tokens=4, prompt_logprobs=k))


def test_prompt_logprobs_assemble_chunk_by_chunk_and_restart_after_preemption():
    torch.manual_seed(2)
    prompt = [3, 9, 1, 40, 7, 22, 5]
    logits = torch.randn(len(prompt), VOCAB)   # position p's logits score token p+1
    ref = torch.log_softmax(logits, dim=-1)
    req = _request(prompt, 1)
    for start, end in [(0, 4), (4, 7)]:
        span = prompt_span(req, start, end)
        record_prompt_logprobs(logits[span.start:span.start + span.count], [span])
    assert [e.token_id for e in req.prompt_logprobs] == prompt[1:]
    for j, e in enumerate(req.prompt_logprobs):
        assert e.logprob == pytest.approx(ref[j, prompt[j + 1]].item(), abs=1e-6)
        assert e.top[0][0] == int(ref[j].argmax())
    # Preempted (recompute from 0): the list is rebuilt, not appended to.
    span = prompt_span(req, 0, 3)
    record_prompt_logprobs(logits[:span.count], [span])
    assert len(req.prompt_logprobs) == 3


def test_prompt_span_only_for_requests_that_asked_and_before_their_first_token():
    assert prompt_span(_request([1, 2, 3], None), 0, 3) is None
    req = _request([1, 2, 3], 0)
    assert prompt_span(req, 0, 3).count == 2          # the last position samples; it scores no prompt token
    assert prompt_span(_request([1], 0), 0, 1) is None  # a one-token prompt has nothing to score
    req.output_token_ids.append(5)
    assert prompt_span(req, 0, 4) is None               # recomputed after preemption: already sent


@pytest.mark.parametrize("kw", [dict(logprobs=-1), dict(logprobs=MAX_LOGPROBS + 1), dict(prompt_logprobs=True),
                                dict(prompt_logprobs=2.0)])
def test_logprob_counts_are_validated(kw):
    with pytest.raises(InvalidRequestError, match=next(iter(kw))):
        SamplingParams(**kw)
