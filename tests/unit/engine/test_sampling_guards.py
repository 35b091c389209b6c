"""Sampling guards, no model: parameters that would poison the sampler are
refused or made greedy, and a batch row with bad logits fails alone."""

import math

import pytest
import torch

from pdcluster.services.engine_errors import InvalidRequestError, RequestFailedError
from pdcluster.services.engine.sampler import NONFINITE_LOGITS, Sampler
from pdcluster.services.sampling_params import (
    GREEDY_TEMPERATURE,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)


@pytest.mark.parametrize("temperature", [0, 5e-324, 1e-300, 1e-40, 1e-8, GREEDY_TEMPERATURE / 2])
def test_temperatures_below_the_greedy_threshold_are_greedy(temperature):
    assert SamplingParams(temperature=temperature).greedy


@pytest.mark.parametrize("temperature", [GREEDY_TEMPERATURE, 0.5, 2.0, 1e30])
def test_larger_temperatures_sample(temperature):
    assert not SamplingParams(temperature=temperature).greedy


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40, 1e-8])
def test_a_tiny_temperature_picks_the_argmax_and_never_nan(temperature):
    logits = torch.randn(3, 1000) * 30
    sampled = Sampler().sample_batch(logits, ["a", "b", "c"], [SamplingParams(temperature=temperature)] * 3)
    assert sampled.failed == {}
    assert [sampled.token_ids[r] for r in "abc"] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=math.nan), "temperature must be >= 0 and finite"),
    (dict(temperature=math.inf), "temperature must be >= 0 and finite"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\]"),
    (dict(top_p=math.inf), r"top_p must be in \(0, 1\]"),
    (dict(top_k=True), "top_k must be an integer"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(seed=True), "seed must be a 64-bit integer"),
    (dict(seed=2**64), "seed must be a 64-bit integer"),
    (dict(seed=1.5), "seed must be a 64-bit integer"),
    (dict(stop=("a",) * (MAX_STOP_STRINGS + 1)), f"the limit is {MAX_STOP_STRINGS}: keep the stop strings"),
    (dict(stop="x" * (MAX_STOP_STRING_CHARS + 1)), f"the limit is {MAX_STOP_STRING_CHARS}: shorten it"),
    (dict(stop=("ok", "")), "stop holds an empty string: drop it"),
    (dict(stop=""), "stop holds an empty string"),
    (dict(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))), f"the limit is {MAX_STOP_TOKEN_IDS}"),
    (dict(stop_token_ids=(1, True)), "stop_token_ids must be non-negative integers"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list"),
])
def test_bad_params_are_refused_naming_the_limit(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)
    field = next(iter(kw))
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert str(e.value).startswith(field)  # the OpenAI layer names the param from the first word


def test_params_at_the_limits_are_accepted():
    p = SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                       stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)), seed=-2**63, top_p=1e-30)
    assert len(p.stop) == MAX_STOP_STRINGS and isinstance(p.stop_token_ids, tuple)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_row_fails_alone_and_the_others_sample(bad):
    logits = torch.randn(4, 64)
    logits[2, 7] = bad
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0.8, seed=2), SamplingParams(temperature=0)]
    sampled = Sampler().sample_batch(logits, ["g0", "s1", "bad", "g3"], params)
    assert sampled.failed == {"bad": NONFINITE_LOGITS}
    assert set(sampled.token_ids) == {"g0", "s1", "g3"}
    assert sampled.token_ids["g0"] == int(logits[0].argmax()) and sampled.token_ids["g3"] == int(logits[3].argmax())


def test_a_greedy_nan_row_fails_instead_of_returning_a_garbage_argmax():
    logits = torch.randn(2, 32)
    logits[0] = math.nan
    sampled = Sampler().sample_batch(logits, ["nan", "ok"], [SamplingParams(temperature=0)] * 2)
    assert sampled.failed == {"nan": NONFINITE_LOGITS} and sampled.token_ids == {"ok": int(logits[1].argmax())}


def test_probabilities_that_overflow_fail_that_row():
    # Finite logits, but / temperature overflows fp32: softmax would be NaN.
    logits = torch.zeros(2, 16)
    logits[0, 3] = 3e38
    sampled = Sampler().sample_batch(logits, ["huge", "fine"], [SamplingParams(temperature=1e-5, seed=0),
                                                                  SamplingParams(temperature=1.0, seed=0)])
    assert list(sampled.failed) == ["huge"] and "temperature=1e-05" in sampled.failed["huge"]
    assert 0 <= sampled.token_ids["fine"] < 16


@pytest.mark.parametrize("top_p", [1e-30, 5e-324])  # 5e-324 is 0 in fp32: the best token must still stay
def test_top_p_tiny_keeps_only_the_best_token(top_p):
    logits = torch.randn(1, 500)
    sampled = Sampler().sample_batch(logits, ["r"], [SamplingParams(temperature=1.0, top_p=top_p, seed=3)])
    assert sampled.token_ids == {"r": int(logits.argmax())}


def test_sample_raises_a_typed_error_when_a_row_failed():
    logits = torch.randn(2, 8)
    logits[1] = math.nan
    with pytest.raises(RequestFailedError, match="request 'b': numerical error in this request's logits"):
        Sampler().sample(logits, ["a", "b"], [SamplingParams(temperature=0)] * 2)
