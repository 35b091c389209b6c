"""The penalties, logit_bias and min_tokens through the OpenAI layer: what a
client sends reaches the engine as SamplingParams, the bounds are published
in the schema, and what stays unimplemented is still a 400 saying so."""

from __future__ import annotations

import pytest
from openai_fakes import CHAT, assert_openai_error

from pdcluster.services.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from pdcluster.services.openai import create_app

C, CC = "/v1/completions", "/v1/chat/completions"


def _body(path: str, extra: dict) -> dict:
    return {**({"prompt": "Hi"} if path == C else {"messages": CHAT}), **extra}


@pytest.mark.parametrize("path", [C, CC])
async def test_every_field_reaches_the_engine(client, backend, path):
    extra = {"presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
             "logit_bias": {"50256": -100, "7": 2.5}, "min_tokens": 3, "max_tokens": 10, "temperature": 0}
    r = await client.post(path, json=_body(path, extra))
    assert r.status_code == 200, r.text
    p: SamplingParams = backend.requests[0].params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1.5, -0.5, 1.2)
    assert p.logit_bias == ((7, 2.5), (50256, -100.0))
    assert (p.min_tokens, p.max_tokens) == (3, 10) and p.adjusts_logits


async def test_defaults_adjust_nothing(client, backend):
    r = await client.post(C, json={"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 200, r.text
    p = backend.requests[0].params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias, p.min_tokens) == (
        0.0, 0.0, 1.0, (), 0)
    assert not p.adjusts_logits


async def test_min_tokens_without_a_cap_counts_up_to_the_servers_cap(client, backend):
    r = await client.post(C, json={"prompt": "Hi", "min_tokens": 10**6})
    assert r.status_code == 200, r.text
    p = backend.requests[0].params
    assert p.min_tokens == p.max_tokens < 10**6


async def test_max_completion_tokens_is_the_cap_min_tokens_is_checked_against(client, backend):
    body = {"messages": CHAT, "min_tokens": 20, "max_tokens": 5, "max_completion_tokens": 30}
    r = await client.post(CC, json=body)
    assert r.status_code == 200, r.text
    assert backend.requests[0].params.min_tokens == 20


@pytest.mark.parametrize("path, extra, param", [
    (C, {"logit_bias": {"5": "1"}}, "logit_bias.5"),            # strict: no string-to-number coercion
    (C, {"logit_bias": [[5, 1]]}, "logit_bias"),
    (CC, {"min_tokens": 2.5}, "min_tokens"),
    (CC, {"min_tokens": None}, "min_tokens"),
    (C, {"repetition_penalty": "1.1"}, "repetition_penalty"),
    (CC, {"n": 17, "presence_penalty": 1}, "n"),
    (CC, {"top_logprobs": 3, "logit_bias": {"5": 1}}, "top_logprobs"),
    (CC, {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}], "frequency_penalty": 1},
     "tools[0].function.parameters"),
    (CC, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
          "min_tokens": 2}, "response_format.json_schema.schema"),
])
async def test_bad_types_and_the_still_unsupported_are_400(client, backend, path, extra, param):
    assert_openai_error(await client.post(path, json=_body(path, extra)), 400, param)
    assert backend.requests == []


def test_schema_publishes_the_bounds():
    props = create_app().openapi()["components"]["schemas"]["CompletionRequest"]["properties"]
    bias = next(s for s in props["logit_bias"]["anyOf"] if s.get("type") == "object")
    assert bias["maxProperties"] == MAX_LOGIT_BIAS_ENTRIES
    assert bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}
    assert bias["propertyNames"] == {"pattern": "^[0-9]{1,19}$"}
    assert props["min_tokens"]["minimum"] == 0
    assert (props["presence_penalty"]["minimum"], props["presence_penalty"]["maximum"]) == (-2, 2)
    assert (props["repetition_penalty"]["minimum"], props["repetition_penalty"]["maximum"]) == (1e-30, 1e30)
