"""A resumed request whose remainder is long goes through a prefill replica
(issue 19): the prefill engine computes prompt + the tokens already sent and
samples the next one, the blocks go over a real pull (socket backend) into a
decode engine that reserved prompt + prior output, and decoding continues
there -- the same tokens as one undisturbed run (greedy, seeded, with
penalties), text deltas that concatenate to the undisturbed text, stop
strings that see the prior tokens, each token counted once, logprobs for
every new token, and every block back on both engines.

    undisturbed   [ prompt | t0 .. t(k-1) | tk | t(k+1) ...      ]
    resumed       prefill: prompt + t0..t(k-1) -> tk  ==pull==>  decode: t(k+1) ...

fp32 weights, as in test_engine_resume.py (bf16 resumes exactly too, since
the prior tokens are recomputed decode-shaped: test_engine_resume_bf16.py)."""

from __future__ import annotations

import pytest

from pdcluster.services.engine.engine import Engine
from pdcluster.services.sampling_params import SamplingParams
from tests.integration.engine.conftest import make_engine
from tests.integration.engine.hand_off import prefill_only, pull_and_commit

N = 24


@pytest.fixture(scope="module")
def engines(smol_fp32) -> dict[str, Engine]:
    return {role: make_engine(smol_fp32, num_kv_blocks=128) for role in ("whole", "prefill", "decode")}


@pytest.fixture(scope="module")
def prompt(smol_fp32) -> list[int]:
    return smol_fp32.tokenizer.encode("The history of the printing press begins")


def _undisturbed(engine: Engine, prompt, params):
    """Tokens, each one's text delta and logprob, and the finish reason."""
    engine.add_request("u", prompt, params)
    tokens, deltas, logprobs, reason = [], [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            deltas.append(out.text_delta)
            logprobs += out.logprobs or []
            reason = out.finish_reason.value if out.finished else reason
    return tokens, deltas, logprobs, reason


def _resumed(engines: dict[str, Engine], prompt, params, prior):
    """The new tokens of a request resumed after ``prior`` through the
    prefill engine and a hand-off, as the gateway would stream them."""
    prefill, decode = engines["prefill"], engines["decode"]
    requests, priors = [("r", prompt, params)], {"r": prior}
    done = prefill_only(prefill, requests, priors)["r"]
    assert done.prefill is not None, "the first token after the prior output ended it: pick another cut"
    assert done.prefill.num_tokens == len(prompt)  # usage counts the prompt, not the prior output
    assert len(done.prefill.block_ids) == -(-(len(prompt) + len(prior)) // prefill.kv_spec.block_size)
    pull_and_commit(prefill, decode, requests, {"r": done}, priors)
    tokens, deltas, logprobs = list(done.new_token_ids), [done.text_delta], list(done.logprobs or [])
    reason, num_output_tokens = None, None
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
            deltas.append(out.text_delta)
            logprobs += out.logprobs or []
            reason = out.finish_reason.value if out.finished else reason
            num_output_tokens = out.num_output_tokens
    assert num_output_tokens == len(prior) + len(tokens)  # each token counted once: prior + new
    return tokens, deltas, logprobs, reason


def _all_blocks_back(engines: dict[str, Engine]) -> None:
    for engine in engines.values():
        engine.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
        assert not engine.requests and not engine.awaiting_kv and len(engine.leases) == 0


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=N, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, frequency_penalty=0.7,
                   presence_penalty=0.3, repetition_penalty=1.2, logprobs=0),
], ids=["greedy", "seeded+penalties"])
def test_a_resumed_request_through_a_hand_off_continues_the_original(engines, prompt, params):
    tokens, deltas, logprobs, reason = _undisturbed(engines["whole"], prompt, params)
    assert len(tokens) == N and reason == "length"
    for cut in (1, 11):  # 11: prompt + prior output fill a whole block (16 tokens): hashed, pulled, cached
        got, got_deltas, got_logprobs, got_reason = _resumed(engines, prompt, params, tokens[:cut])
        assert tokens[:cut] + got == tokens, cut   # max_tokens counts the prior tokens: N - cut new ones
        assert got_reason == "length"
        assert "".join(deltas[:cut] + got_deltas) == "".join(deltas), cut
        assert [lp.token_id for lp in got_logprobs] == got  # one per new token, the one it scores
        for want, have in zip(logprobs[cut:], got_logprobs):
            assert have.logprob == pytest.approx(want.logprob, abs=1e-3)
            assert [t for t, _ in have.top] == [t for t, _ in want.top]
        _all_blocks_back(engines)


def test_stop_strings_across_the_hand_off_see_the_prior_tokens(engines, prompt, smol_fp32):
    plain = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    tokens, deltas, _, _ = _undisturbed(engines["whole"], prompt, plain)
    text = "".join(deltas)
    # A stop string that starts in the prior tokens' text and ends after them.
    stop_at = len(smol_fp32.tokenizer.decode(tokens[:6]))
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, stop=(text[stop_at - 2:stop_at + 3],))
    full, full_deltas, _, reason = _undisturbed(engines["whole"], prompt, params)
    assert reason == "stop" and len(full) < N
    got, got_deltas, _, got_reason = _resumed(engines, prompt, params, full[:5])
    assert got_reason == "stop" and full[:5] + got == full
    assert "".join(full_deltas[:5] + got_deltas) == "".join(full_deltas)
    _all_blocks_back(engines)
