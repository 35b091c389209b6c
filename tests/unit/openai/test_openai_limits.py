"""Bounded inputs: every range and cap is a 400 with an OpenAI error body
naming the field and the bound, before the backend is called; the values
at the edge of each bound are accepted; a prompt that can never fit is
refused by its length alone, without tokenizing it; a long prompt is
tokenized off the event loop, so it does not stall the other requests."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from openai_fakes import CHAT, assert_openai_error

from pdcluster.services.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from pdcluster.services.openai.prompt import OFF_LOOP_PROMPT_SIZE, longest_token_chars

C, CC = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]
INT64_MAX = 2**63 - 1

# (endpoint, fields added to a valid body, param named, words the message must hold)
OUT_OF_BOUNDS = [
    (C, {"stop": ["x"] * 500}, "stop", ["500", f"limit is {MAX_STOP_STRINGS}"]),
    (CC, {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", [str(MAX_STOP_STRINGS + 1), str(MAX_STOP_STRINGS)]),
    (C, {"stop": ["ok", "y" * (MAX_STOP_STRING_CHARS + 1)]}, "stop", ["stop[1]", str(MAX_STOP_STRING_CHARS + 1),
                                                                   f"limit is {MAX_STOP_STRING_CHARS}"]),
    (CC, {"stop": "y" * (MAX_STOP_STRING_CHARS + 1)}, "stop", [f"limit is {MAX_STOP_STRING_CHARS}"]),
    (C, {"stop": ["ok", ""]}, "stop", ["non-empty"]),
    (C, {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids",
     [str(MAX_STOP_TOKEN_IDS + 1), f"limit is {MAX_STOP_TOKEN_IDS}"]),
    (C, {"stop_token_ids": [5, 2**70]}, "stop_token_ids", [str(2**70)]),
    (C, {"stop_token_ids": [-1]}, "stop_token_ids", ["-1"]),
    (C, {"temperature": 3}, "temperature", ["out of range", "between 0 and 2"]),
    (CC, {"temperature": 2.0001}, "temperature", ["between 0 and 2"]),
    (CC, {"temperature": -1e-300}, "temperature", ["between 0 and 2"]),
    (C, {"top_p": 0}, "top_p", ["greater than 0 and at most 1"]),
    (CC, {"top_p": 1.01}, "top_p", ["greater than 0 and at most 1"]),
    (C, {"presence_penalty": 5}, "presence_penalty", ["out of range", "between -2 and 2"]),
    (CC, {"presence_penalty": -2.5}, "presence_penalty", ["out of range", "between -2 and 2"]),
    (C, {"frequency_penalty": 2.01}, "frequency_penalty", ["out of range", "between -2 and 2"]),
    (C, {"top_k": -2}, "top_k", ["at least -1", "-1 or 0 = off"]),
    (C, {"max_tokens": 0}, "max_tokens", ["at least 1"]),
    (CC, {"max_tokens": -5}, "max_tokens", ["at least 1"]),
    (CC, {"max_completion_tokens": 0}, "max_completion_tokens", ["at least 1"]),
    (C, {"seed": INT64_MAX + 1}, "seed", [str(INT64_MAX), "64-bit"]),
    (CC, {"seed": -(2**63) - 1}, "seed", [str(-(2**63))]),
    (C, {"n": 0}, "n", ["out of range", "between 1 and 16"]),
    (CC, {"n": -1}, "n", ["out of range", "between 1 and 16"]),
    (CC, {"n": 17}, "n", ["out of range", "between 1 and 16"]),
    (CC, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", ["out of range", "between 0 and 20"]),
    (C, {"logprobs": 21}, "logprobs", ["out of range", "between 0 and 20"]),
    (C, {"repetition_penalty": 0}, "repetition_penalty", ["out of range", "between 1e-30 and 1e+30", "1 = off"]),
    (CC, {"repetition_penalty": -1.2}, "repetition_penalty", ["between 1e-30 and 1e+30"]),
    (C, {"repetition_penalty": 1e31}, "repetition_penalty", ["between 1e-30 and 1e+30"]),
    (C, {"min_tokens": -1}, "min_tokens", ["out of range", "at least 0"]),
    (C, {"min_tokens": 6, "max_tokens": 5}, "min_tokens", ["min_tokens is 6", "max_tokens (5)"]),
    (CC, {"min_tokens": 9, "max_completion_tokens": 8}, "min_tokens", ["max_completion_tokens (8)"]),
    (CC, {"min_tokens": 9, "max_tokens": 8}, "min_tokens", ["max_tokens (8)"]),
    (C, {"logit_bias": {"5": 100.5}}, "logit_bias", ["token 5", "out of range", "between -100 and 100"]),
    (CC, {"logit_bias": {"5": -101}}, "logit_bias", ["between -100 and 100"]),
    (C, {"logit_bias": {"hello": 1}}, "logit_bias", ["'hello' is not a token id", "decimal strings"]),
    (C, {"logit_bias": {"-5": 1}}, "logit_bias", ["not a token id"]),
    (C, {"logit_bias": {"1.5": 1}}, "logit_bias", ["not a token id"]),
    (CC, {"logit_bias": {" 7": 1}}, "logit_bias", ["not a token id"]),
    (C, {"logit_bias": {"\u0661": 1}}, "logit_bias", ["not a token id"]),   # an Arabic-Indic digit
    (C, {"logit_bias": {"9" * 20: 1}}, "logit_bias", ["not a token id"]),
    (C, {"logit_bias": {"7": 1, "007": 2}}, "logit_bias", ["token 7 twice"]),
    (CC, {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias",
     [str(MAX_LOGIT_BIAS_ENTRIES + 1), f"limit is {MAX_LOGIT_BIAS_ENTRIES}"]),
]


def _body(path: str, extra: dict) -> dict:
    return {**({"prompt": "Hi"} if path == C else {"messages": MSGS}), **extra}


@pytest.mark.parametrize("path, extra, param, words", OUT_OF_BOUNDS,
                         ids=[f"{i}-{param}" for i, (_, _, param, _) in enumerate(OUT_OF_BOUNDS)])
async def test_out_of_bounds_is_400_naming_field_and_bound(client, backend, path, extra, param, words):
    err = assert_openai_error(await client.post(path, json=_body(path, extra)), 400, param)
    assert err["code"] == "invalid_value"
    assert all(w in err["message"] for w in words), err["message"]
    assert backend.requests == []


@pytest.mark.parametrize("field, value", [("best_of", 2), ("suffix", "end")])
async def test_in_range_but_unimplemented_is_still_unsupported(client, backend, field, value):
    err = assert_openai_error(await client.post(C, json={"prompt": "Hi", field: value}), 400, field)
    assert err["code"] == "unsupported_parameter" and "not supported" in err["message"]
    assert backend.requests == []


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
async def test_nan_and_infinity_are_400(client, backend, field, literal):
    raw = b'{"prompt": "Hi", "' + field.encode() + b'": ' + literal + b"}"
    r = await client.post(C, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, field)
    assert backend.requests == []


@pytest.mark.parametrize("extra", [
    {"temperature": 1e-300}, {"temperature": 5e-324}, {"temperature": 0}, {"temperature": 2},
    {"top_p": 1}, {"top_p": 1e-9}, {"top_k": -1}, {"top_k": 0}, {"top_k": 10**6},
    {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"n": 1}, {"max_tokens": 1},
    {"seed": INT64_MAX}, {"seed": -(2**63)},
    {"presence_penalty": 2}, {"presence_penalty": -2.0}, {"frequency_penalty": 2.0}, {"frequency_penalty": -2},
    {"repetition_penalty": 1e-30}, {"repetition_penalty": 1e30}, {"min_tokens": 0}, {"min_tokens": 5, "max_tokens": 5},
    {"logit_bias": {str(i): (100 if i % 2 else -100) for i in range(MAX_LOGIT_BIAS_ENTRIES)}},
    {"logit_bias": {}}, {"logit_bias": None}, {"logit_bias": {"0": 0}},
    {"stop": ["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS}, {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))},
])
@pytest.mark.parametrize("path", [C, CC])
async def test_values_at_the_bounds_are_accepted(client, backend, path, extra):
    r = await client.post(path, json=_body(path, extra))
    assert r.status_code == 200, r.text
    params = backend.requests[0].params
    if "temperature" in extra:
        assert params.temperature == extra["temperature"]   # tiny temperatures reach the engine (greedy there)


# -- the prompt's length, before tokenizing ----------------------------------------------------

@pytest.fixture
def encode_calls(tokenizer, monkeypatch) -> list[tuple[int, int]]:
    """(characters, thread id) of every encode; the chat template encodes through it too."""
    calls, real = [], tokenizer.encode

    def spy(text, *args, **kwargs):
        calls.append((len(text), threading.get_ident()))
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    return calls


async def test_prompt_over_the_character_bound_is_refused_without_tokenizing(client, backend, tokenizer,
                                                                              encode_calls):
    per_token = longest_token_chars(tokenizer)
    assert per_token == max(len(t) for t in tokenizer.hf.get_vocab())
    limit = backend.max_model_len * per_token
    err = assert_openai_error(await client.post(C, json={"prompt": "x" * (limit + 1)}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert all(s in err["message"] for s in (str(limit + 1), str(limit), str(backend.max_model_len)))
    half = "y" * (limit // 2 + 1)
    chat = [{"role": "system", "content": half}, {"role": "user", "content": [{"type": "text", "text": half}]}]
    err = assert_openai_error(await client.post(CC, json={"messages": chat}), 400, "messages")
    assert err["code"] == "context_length_exceeded" and str(limit) in err["message"]
    assert encode_calls == [] and backend.requests == []

    # At the bound the length alone proves nothing: it is tokenized, then refused by its token count.
    err = assert_openai_error(await client.post(C, json={"prompt": "x" * limit}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and len(encode_calls) == 1


async def test_token_id_prompt_longer_than_the_context_is_refused_before_any_work(client, backend):
    ids = [10**7] * (backend.max_model_len + 1)      # outside the vocabulary too: the length is checked first
    err = assert_openai_error(await client.post(C, json={"prompt": ids}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and str(backend.max_model_len) in err["message"]
    assert backend.requests == []


async def test_long_prompts_are_tokenized_off_the_event_loop(client, backend, encode_calls):
    loop_thread = threading.get_ident()
    assert (await client.post(C, json={"prompt": "short", "max_tokens": 1})).status_code == 200
    long_text = "word " * (OFF_LOOP_PROMPT_SIZE // 5 + 1)
    await client.post(C, json={"prompt": long_text, "max_tokens": 1})      # then too long for the fake's context
    many = [{"role": "user", "content": "hi"}] * 200       # little text, but a big template to render
    await client.post(CC, json={"messages": many, "max_tokens": 1})
    assert [thread == loop_thread for _, thread in encode_calls] == [True, False, False]


async def test_a_slow_prompt_does_not_stall_other_requests(client, backend, tokenizer, monkeypatch):
    entered, release, real = threading.Event(), threading.Event(), tokenizer.encode

    def slow_for_long_text(text, *args, **kwargs):
        if len(text) > OFF_LOOP_PROMPT_SIZE:
            entered.set()
            release.wait(120)    # holds its worker thread, not the event loop, until the small one is answered
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_for_long_text)
    big = asyncio.create_task(client.post(C, json={"prompt": "a " * OFF_LOOP_PROMPT_SIZE, "max_tokens": 1}))
    while not entered.is_set():
        await asyncio.sleep(0.005)
    try:
        small = await client.post(CC, json={"messages": CHAT, "max_tokens": 2})  # answered while the big one waits
        assert small.status_code == 200
        assert not big.done()
    finally:
        release.set()
    assert (await big).status_code in (200, 400)
