"""Sampling math and parameter validation, no model."""

import pytest
import torch

from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.engine.sampler import Sampler, probabilities
from pdcluster.services.sampling_params import SamplingParams


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0])
    p = probabilities(logits, SamplingParams(top_k=2))
    assert int((p > 0).sum()) == 2 and p.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, SamplingParams(top_p=0.7))
    assert (p > 0).tolist() == [True, True, False, False]
    assert p[0].item() == pytest.approx(0.5 / 0.8, rel=1e-5)
    best_only = probabilities(logits, SamplingParams(top_p=0.01))
    assert (best_only > 0).tolist() == [True, False, False, False]


def test_temperature_sharpens():
    logits = torch.tensor([2.0, 1.0])
    assert probabilities(logits, SamplingParams(temperature=0.5))[0] > probabilities(logits, SamplingParams())[0]


def test_seeded_draws_repeat_and_greedy_is_argmax():
    logits = torch.randn(1, 50)
    p = SamplingParams(seed=7)
    draws = [Sampler().sample(logits, ["r"], [p])[0] for _ in range(3)]
    assert len(set(draws)) == 1
    assert Sampler().sample(logits, ["g"], [SamplingParams(temperature=0)]) == [int(logits.argmax())]
    assert SamplingParams(top_k=1).greedy


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(max_tokens=True), dict(temperature=-0.1), dict(top_p=0),
                                dict(top_p=1.01), dict(top_k=-1), dict(stop=[1]), dict(stop_token_ids=(-3,))])
def test_bad_params_raise_typed_errors(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_stop_string_becomes_a_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
