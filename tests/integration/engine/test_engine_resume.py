"""A request resumed from prompt + the tokens already generated (what the
gateway sends after a decode replica died) continues exactly where the
original was: same tokens (greedy and seeded), text deltas that concatenate
to the original text, and penalties and stop strings that see
the prior tokens as output.

In float32 here; bf16, the default, in test_engine_resume_bf16.py (exact
there too: the prior tokens are recomputed decode-shaped, runner.py)."""

from __future__ import annotations

import pytest

from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.sampling_params import SamplingParams
from tests.integration.engine.conftest import make_engine

N = 24


@pytest.fixture(scope="module")
def engine(smol_fp32):
    return make_engine(smol_fp32, num_kv_blocks=128)


@pytest.fixture(scope="module")
def prompt(smol_fp32) -> list[int]:
    return smol_fp32.tokenizer.encode("The history of the printing press begins")


def _run(engine, prompt, params, prior=()) -> tuple[list[int], list[str], str]:
    """Tokens, the text delta that came with each, and the finish reason."""
    engine.add_request("r", prompt, params, prior_output_token_ids=prior)
    tokens, deltas, reason = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert len(out.new_token_ids) == 1  # the sync engine: one output per token
            tokens += out.new_token_ids
            deltas.append(out.text_delta)
            reason = out.finish_reason.value if out.finished else reason
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert engine.runner.sampler._generators == {}  # forgotten with the request
    return tokens, deltas, reason


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=N, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=0.8, seed=1234, ignore_eos=True),
    SamplingParams(max_tokens=N, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, frequency_penalty=0.7,
                   presence_penalty=0.3, repetition_penalty=1.2),
], ids=["greedy", "seeded", "seeded+penalties"])
def test_a_resumed_request_continues_the_original(engine, prompt, params):
    tokens, deltas, reason = _run(engine, prompt, params)
    assert len(tokens) == N and reason == "length"
    for cut in (1, 9):
        resumed, rest, reason2 = _run(engine, prompt, params, prior=tokens[:cut])
        assert tokens[:cut] + resumed == tokens, cut  # max_tokens counts the prior tokens: N - cut new ones
        assert reason2 == "length"
        assert "".join(deltas[:cut] + rest) == "".join(deltas), cut


def test_stop_strings_see_the_prior_tokens_as_output(engine, prompt, smol_fp32):
    tokens, deltas, _ = _run(engine, prompt, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
    text = "".join(deltas)
    # A stop string that starts in the prior tokens' text and ends after them.
    stop_at = len(smol_fp32.tokenizer.decode(tokens[:6]))
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, stop=[text[stop_at - 2:stop_at + 3]])
    full, full_deltas, reason = _run(engine, prompt, params)
    assert reason == "stop"
    cut = 5
    resumed, rest, reason2 = _run(engine, prompt, params, prior=full[:cut])
    assert reason2 == "stop" and full[:cut] + resumed == full
    assert "".join(full_deltas[:cut] + rest) == "".join(full_deltas)


def test_a_prior_output_that_fills_max_tokens_is_refused(engine, prompt):
    with pytest.raises(InvalidRequestError, match="nothing is left to generate"):
        engine.add_request("x", prompt, SamplingParams(max_tokens=3), prior_output_token_ids=[1, 2, 3])
    with pytest.raises(InvalidRequestError, match="outside this model's vocabulary"):
        engine.add_request("x", prompt, SamplingParams(max_tokens=8), prior_output_token_ids=[10**9])
    assert "x" not in engine.requests
