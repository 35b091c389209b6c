"""Penalties, logit_bias and min_tokens in the sampler, no model: the batched
code against a plain per-token reference written from the formulas, on one
batch whose rows all ask for different things."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pdcluster.services.engine.categorical import draw
from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.engine.penalties import Penalties
from pdcluster.services.engine.random_stream import position_seed
from pdcluster.services.engine.sampler import NONFINITE_LOGITS, Sampler, probabilities
from pdcluster.services.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams

VOCAB = 96
EOS = (0, 95)


@dataclass
class History:
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def reference(row: torch.Tensor, p: SamplingParams, h: History, eos=EOS) -> torch.Tensor:
    """One row, token by token, from the formulas, in fp32 (numpy rounds
    every operation to float32, as torch does)."""
    f32 = np.float32
    x = [f32(v) for v in row.tolist()]
    if len(h.output_token_ids) < p.min_tokens:
        for t in (() if p.ignore_eos else eos) + p.stop_token_ids:
            if t < len(x):
                x[t] = f32(-np.inf)
    for t, bias in p.logit_bias:
        x[t] = x[t] + f32(bias)
    seen = set(h.prompt_token_ids) | set(h.output_token_ids)
    rep = f32(p.repetition_penalty)
    for t in range(len(x)):
        if t in seen and p.repetition_penalty != 1.0:
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        count = h.output_token_ids.count(t)
        x[t] = x[t] - (f32(p.frequency_penalty) * f32(count) + f32(p.presence_penalty) * f32(count > 0))
    return torch.tensor(np.array(x, dtype=np.float32))


def _batch():
    """Eight rows, each asking for something else (one asks for nothing)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(8, VOCAB, generator=gen) * 3
    logits[:, 5] = 0.0  # an exact zero under a repetition penalty: x * p, not x / p
    prompt = [5, 7, 7, 9, 30, 31]
    out = [7, 12, 12, 12, 40, 3, 95]
    rows = [
        ("plain", SamplingParams(temperature=0), History(prompt, out)),
        ("freq", SamplingParams(temperature=0, frequency_penalty=1.5), History(prompt, out)),
        ("pres", SamplingParams(temperature=0, presence_penalty=-0.75, frequency_penalty=0.5), History(prompt, out)),
        ("rep_up", SamplingParams(temperature=0, repetition_penalty=1.7), History(prompt, out)),
        ("rep_down", SamplingParams(temperature=0, repetition_penalty=0.6, frequency_penalty=-2),
         History([1, 2, 3], [4, 4])),
        ("bias", SamplingParams(temperature=0, logit_bias={3: 100, 17: -100, 50: 0.3}), History(prompt, out)),
        ("min", SamplingParams(temperature=0, min_tokens=9, stop_token_ids=(44, 500), logit_bias={0: 5}),
         History(prompt, out)),
        ("all", SamplingParams(temperature=0, min_tokens=4, ignore_eos=True, stop_token_ids=(8,),
                               repetition_penalty=1.3, frequency_penalty=0.25, presence_penalty=2,
                               logit_bias={8: 1, 9: -2.5}), History(prompt, [9, 12, 9])),
    ]
    ids = [r[0] for r in rows]
    return logits, ids, [r[1] for r in rows], {rid: h for rid, _, h in rows}


def test_every_row_matches_the_reference_exactly():
    logits, ids, params, histories = _batch()
    before = logits.clone()
    got = Penalties(EOS, histories).apply(logits, ids, params)
    assert torch.equal(logits, before)  # the model's logits are not written to
    for row, (rid, p) in enumerate(zip(ids, params)):
        want = reference(logits[row], p, histories[rid])
        assert torch.equal(got[row], want), (rid, (got[row] - want).abs().max())
    assert torch.equal(got[0], logits[0])  # the row without penalties is untouched
    assert got[6, 0] == got[6, 95] == got[6, 44] == -math.inf  # min_tokens beats a +5 bias on EOS
    assert got[7, 8] == -math.inf and math.isfinite(got[7, 0])  # ignore_eos: only the stop id is masked


def test_greedy_rows_take_the_argmax_of_the_penalised_logits():
    logits, ids, params, histories = _batch()
    tokens = Sampler(EOS, histories).sample(logits, ids, params)
    want = [int(reference(logits[r], p, histories[rid]).argmax()) for r, (rid, p) in enumerate(zip(ids, params))]
    assert tokens == want
    assert tokens[5] == 3  # +100 forces the token
    assert tokens != logits.argmax(dim=-1).tolist()


def test_sampled_rows_draw_from_the_penalised_logits_then_temperature():
    logits, ids, params, histories = _batch()
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3, frequency_penalty=p.frequency_penalty,
                             presence_penalty=p.presence_penalty, repetition_penalty=p.repetition_penalty,
                             logit_bias=p.logit_bias, min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids,
                             ignore_eos=p.ignore_eos) for p in params]
    tokens = Sampler(EOS, histories).sample(logits, ids, params)
    for row, (rid, p) in enumerate(zip(ids, params)):
        probs = probabilities(reference(logits[row], p, histories[rid]), p)
        # The draw for output position k is seeded from (seed, k): random_stream.py.
        seed = position_seed(3, len(histories[rid].output_token_ids))
        want = draw(probs, torch.Generator().manual_seed(seed))
        assert tokens[row] == want, rid


def test_logit_bias_forces_and_forbids_tokens():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    best = int(logits[0].argmax())
    forced = SamplingParams(temperature=1.0, seed=0, logit_bias={42: 100})
    banned = SamplingParams(temperature=0, logit_bias={best: -100})
    for _ in range(20):
        assert Sampler().sample(logits[:1], ["f"], [forced]) == [42]
    assert Sampler().sample(logits[:1], ["b"], [banned]) != [best]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, 95] = 10.0  # EOS is the argmax
    logits[0, 44] = 9.0   # then a stop token
    h = History([1, 2], [])
    sampler = Sampler(EOS, {"r": h})
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(44,))
    picks = []
    for _ in range(3):
        picks.append(sampler.sample(logits, ["r"], [p])[0])
        h.output_token_ids.append(picks[-1])
    assert picks[0] not in (95, 44) and picks[1] not in (95, 44) and picks[2] == 95


def test_stop_ids_outside_the_vocabulary_are_skipped():
    logits = torch.randn(1, VOCAB)
    p = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(10**9,))
    # min_tokens masks the EOS ids (in the vocabulary) and skips the stop id (outside it): the argmax of the
    # rest.  Random logits put an EOS id on top in 2 of 96 draws; the expectation must not depend on the draw.
    allowed = logits.clone()
    allowed[0, list(EOS)] = float("-inf")
    assert Sampler(EOS).sample(logits, ["r"], [p]) == [int(allowed.argmax())]


def test_a_batch_without_penalties_never_reaches_them(monkeypatch):
    def boom(*args):
        raise AssertionError("penalties applied to a batch without any")
    monkeypatch.setattr(Penalties, "apply", boom)
    logits = torch.randn(16, VOCAB)
    params = [SamplingParams(temperature=0)] * 8 + [SamplingParams(temperature=0.8, seed=1)] * 8
    result = Sampler(EOS).sample_batch(logits, [f"r{i}" for i in range(16)], params)
    assert not result.failed and len(result.token_ids) == 16


def test_rows_whose_min_tokens_are_reached_are_left_alone():
    logits = torch.randn(2, VOCAB)
    h = History([1], [4, 5, 6])
    assert Penalties(EOS, {"a": h, "b": h}).apply(logits, ["a", "b"], [SamplingParams(min_tokens=3)] * 2) is logits


def test_a_nonfinite_model_row_still_fails_alone_and_min_tokens_inf_does_not():
    logits = torch.randn(3, VOCAB)
    logits[1, 20] = math.nan
    params = [SamplingParams(temperature=0, min_tokens=4), SamplingParams(temperature=0, frequency_penalty=1),
              SamplingParams(temperature=0.9, seed=2, min_tokens=4)]
    result = Sampler(EOS).sample_batch(logits, ["a", "nan", "c"], params)
    assert result.failed == {"nan": NONFINITE_LOGITS} and set(result.token_ids) == {"a", "c"}
    assert result.token_ids["a"] not in EOS and result.token_ids["c"] not in EOS


def test_prompt_ids_are_built_once_per_request_and_forgotten():
    h = History([3, 4, 5], [])
    sampler = Sampler(EOS, {"r": h})
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    sampler.sample(torch.randn(1, VOCAB), ["r"], [p])
    cached = sampler.penalties._prompt_ids["r"]
    sampler.sample(torch.randn(1, VOCAB), ["r"], [p])
    assert sampler.penalties._prompt_ids["r"] is cached
    sampler.forget("r")
    assert "r" not in sampler.penalties._prompt_ids


def test_logit_bias_is_normalised_to_sorted_pairs():
    p = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert p.logit_bias == ((2, -3.5), (9, 1.0)) and p.adjusts_logits
    assert SamplingParams(logit_bias=[(9, 1), (2, -3.5)]) == p
    assert not SamplingParams(repetition_penalty=1, presence_penalty=0, frequency_penalty=0.0).adjusts_logits


@pytest.mark.parametrize("kw, match", [
    (dict(presence_penalty=2.01), "presence_penalty must be between -2 and 2"),
    (dict(frequency_penalty=-3), "frequency_penalty must be between -2 and 2"),
    (dict(frequency_penalty=math.nan), "frequency_penalty must be between -2 and 2"),
    (dict(presence_penalty=True), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty must be between 1e-30 and 1e\\+30"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be between"),
    (dict(repetition_penalty=math.inf), "repetition_penalty must be between"),
    (dict(logit_bias={1: 100.5}), "logit_bias of token 1 is 100.5"),
    (dict(logit_bias={"1": 5}), "logit_bias keys must be token ids"),
    (dict(logit_bias={-1: 5}), "logit_bias keys must be token ids"),
    (dict(logit_bias={True: 5}), "logit_bias keys must be token ids"),
    (dict(logit_bias={1: math.nan}), "logit_bias of token 1"),
    (dict(logit_bias=[(1, 2), (1, 3)]), "logit_bias names a token id twice"),
    (dict(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}), f"the limit is {MAX_LOGIT_BIAS_ENTRIES}"),
    (dict(logit_bias=5), "logit_bias must map token ids to biases"),
    (dict(min_tokens=17), "min_tokens must be an integer from 0 to max_tokens \\(16\\)"),
    (dict(min_tokens=-1), "min_tokens must be"),
    (dict(min_tokens=2.0), "min_tokens must be"),
])
def test_bad_penalty_params_are_refused_naming_the_field(kw, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        SamplingParams(**kw)
    assert str(e.value).startswith(next(iter(kw)))


def test_params_at_the_limits_are_accepted():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-30, min_tokens=16,
                       logit_bias={i: (-100 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS_ENTRIES)})
    assert len(p.logit_bias) == MAX_LOGIT_BIAS_ENTRIES and p.min_tokens == p.max_tokens
