"""min_tokens, logit_bias and the penalties on the real model, through the
engine: what a client sees, and that a penalised request shares a batch
without changing its neighbours' tokens."""

from __future__ import annotations

import pytest

from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.engine.request import FinishReason
from pdcluster.services.sampling_params import SamplingParams, greedy
from tests.integration.engine.conftest import make_engine


def _no_leak(engine):
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert engine.runner.sampler.penalties._prompt_ids == {}  # forgotten with their requests


@pytest.fixture(scope="module")
def engine(smol_bf16):
    return make_engine(smol_bf16, num_kv_blocks=128)


@pytest.fixture(scope="module")
def short_answer(smol_bf16) -> list[int]:
    """A chat prompt the model answers in a word, then EOS."""
    tok = smol_bf16.tokenizer
    return tok.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}])


@pytest.fixture(scope="module")
def repetitive(smol_bf16) -> list[int]:
    return smol_bf16.tokenizer.encode(" ".join(["apple banana"] * 6))


def _repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_without_min_tokens_the_answer_ends_early(engine, short_answer):
    out = engine.generate([short_answer], greedy(32))[0]
    assert out.finish_reason is FinishReason.STOP and len(out.new_token_ids) < 8
    assert out.new_token_ids[-1] in engine.tokenizer.eos_token_ids
    _no_leak(engine)


@pytest.mark.parametrize("min_tokens", [8, 20])
def test_min_tokens_holds_back_eos(engine, short_answer, min_tokens):
    eos = set(engine.tokenizer.eos_token_ids)
    out = engine.generate([short_answer], greedy(32, min_tokens=min_tokens))[0]
    assert out.error is None and len(out.new_token_ids) >= min_tokens
    assert not eos & set(out.new_token_ids[:min_tokens])
    _no_leak(engine)


def test_min_tokens_holds_back_stop_token_ids_too(engine, short_answer):
    first = engine.generate([short_answer], greedy(1))[0].new_token_ids[0]
    stopped = engine.generate([short_answer], greedy(16, stop_token_ids=[first]))[0]
    assert stopped.new_token_ids == [first] and stopped.finish_reason is FinishReason.STOP
    held = engine.generate([short_answer], greedy(16, stop_token_ids=[first], min_tokens=4))[0]
    assert len(held.new_token_ids) >= 4 and first not in held.new_token_ids[:4]
    _no_leak(engine)


def test_frequency_penalty_reduces_repeats(engine, repetitive):
    plain = engine.generate([repetitive], greedy(32, ignore_eos=True))[0].new_token_ids
    penalised = engine.generate([repetitive], greedy(32, ignore_eos=True, frequency_penalty=2.0))[0].new_token_ids
    assert _repeats(plain) >= 8, plain  # the prompt makes the model repeat itself
    assert _repeats(penalised) <= _repeats(plain) // 2, (plain, penalised)
    _no_leak(engine)


def test_repetition_and_presence_penalties_change_greedy_output(engine, repetitive):
    plain = engine.generate([repetitive], greedy(24, ignore_eos=True))[0].new_token_ids
    rep = engine.generate([repetitive], greedy(24, ignore_eos=True, repetition_penalty=1.3))[0].new_token_ids
    pres = engine.generate([repetitive], greedy(24, ignore_eos=True, presence_penalty=2.0))[0].new_token_ids
    assert _repeats(rep) < _repeats(plain) and _repeats(pres) < _repeats(plain)
    _no_leak(engine)


def test_logit_bias_forces_a_token_greedy_and_sampled(engine, short_answer, smol_bf16):
    token = smol_bf16.tokenizer.encode(" banana")[0]
    for params in (greedy(6, logit_bias={token: 100}),
                   SamplingParams(max_tokens=6, temperature=1.0, seed=5, logit_bias={token: 100})):
        out = engine.generate([short_answer], params)[0]
        assert out.new_token_ids == [token] * 6
    _no_leak(engine)


def test_penalised_rows_leave_their_batch_neighbours_alone(smol_bf16, short_answer, repetitive):
    engine = make_engine(smol_bf16, num_kv_blocks=128)
    alone = engine.generate([repetitive, short_answer], greedy(16, ignore_eos=True))
    mixed = engine.generate(
        [repetitive, repetitive, short_answer, short_answer],
        [greedy(16, ignore_eos=True), greedy(16, ignore_eos=True, frequency_penalty=2.0, repetition_penalty=1.2),
         greedy(16, ignore_eos=True), greedy(16, min_tokens=12, logit_bias={42: 3.0})])
    assert mixed[0].new_token_ids == alone[0].new_token_ids
    assert mixed[2].new_token_ids == alone[1].new_token_ids
    assert mixed[1].new_token_ids != alone[0].new_token_ids and len(mixed[3].new_token_ids) >= 12
    _no_leak(engine)


def test_logit_bias_outside_the_vocabulary_is_refused(engine, short_answer):
    vocab = engine.loaded.config.vocab_size
    with pytest.raises(InvalidRequestError, match=f"logit_bias names token id {vocab}, outside"):
        engine.add_request("bad-bias", short_answer, greedy(4, logit_bias={vocab: 1.0}))
    assert "bad-bias" not in engine.requests
    _no_leak(engine)
