"""Structured output and tools end to end through the official openai
client: 20 JSON schemas (nested objects, enums, arrays) whose outputs parse
and validate, guided_choice / guided_regex, json_object, a tool-call round
trip (call, tool message, answer), a streamed call, and 400s for a bad
schema.  Here (disaggregated) the prefill replica samples the first token
under the grammar and the decode replica continues it; the same tests run
on the colocated session cluster from tests/integration/colocated/
test_colocated_structured.py.  Small schemas and max_tokens keep it fast:
the 20 requests run together."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.integration.cluster.test_cluster_api import wait_no_leaks

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"

_S = {"type": "string", "maxLength": 10}
_I = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMAS: list[tuple[str, dict]] = [
    ("person", {"type": "object", "properties": {"name": _S, "age": _I}, "required": ["name", "age"]}),
    ("flag", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
    ("color", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
               "required": ["color"]}),
    ("tags", {"type": "object", "properties": {"tags": {"type": "array", "items": _S, "maxItems": 3}},
              "required": ["tags"]}),
    ("point", {"type": "object", "properties": {"x": _I, "y": _I}, "required": ["x", "y"]}),
    ("address", {"type": "object", "properties": {"city": _S, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                 "required": ["city", "zip"]}),
    ("nested", {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": _I, "role": {"enum": ["admin", "guest"]}}, "required": ["id", "role"]}}, "required": ["user"]}),
    ("matrix", {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": _I, "maxItems": 2}}}, "required": ["rows"]}),
    ("items", {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": _S, "qty": _I}, "required": ["sku", "qty"]}}}, "required": ["items"]}),
    ("status", {"enum": ["ok", "error", "pending"]}),
    ("number_list", {"type": "array", "items": _I, "minItems": 1, "maxItems": 4}),
    ("bool_array", {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}),
    ("price", {"type": "object", "properties": {"amount": {"type": "number", "minimum": 0, "maximum": 1000},
                                                 "currency": {"enum": ["EUR", "USD"]}},
               "required": ["amount", "currency"]}),
    ("optional", {"type": "object", "properties": {"a": _I, "b": _S}, "required": ["a"]}),
    ("nullable", {"type": "object", "properties": {"note": {"anyOf": [_S, {"type": "null"}]}}, "required": ["note"]}),
    ("deep", {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object",
              "properties": {"c": {"enum": [1, 2, 3]}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]}),
    ("book", {"type": "object", "properties": {"title": _S, "year": {"type": "integer", "minimum": 1900,
              "maximum": 2030}, "genre": {"enum": ["fiction", "science"]}}, "required": ["title", "year", "genre"]}),
    ("weather", {"type": "object", "properties": {"temp_c": {"type": "integer", "minimum": -50, "maximum": 50},
                 "sky": {"enum": ["sunny", "cloudy", "rain"]}}, "required": ["temp_c", "sky"]}),
    ("pair", {"type": "array", "prefixItems": [_S, _I], "items": False, "minItems": 2}),
    ("event", {"type": "object", "properties": {"name": _S, "attendees": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"who": _S, "vip": {"type": "boolean"}}, "required": ["who", "vip"]}}},
        "required": ["name", "attendees"]}),
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}


def _schema_request(client, name: str, schema: dict):
    # Admission may shed a burst (429 + Retry-After, by the TTFT SLO): the client waits and retries, as users do.
    return client.with_options(max_retries=8).chat.completions.create(
        model=MODEL, temperature=0, max_tokens=96,
        messages=[{"role": "user", "content": f"Give an example {name} as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})


def test_twenty_schemas_parse_and_validate(cluster, client):
    with ThreadPoolExecutor(max_workers=4) as pool:  # under the pools' queue cap (8)
        responses = list(pool.map(lambda s: _schema_request(client, *s), SCHEMAS))
    for (name, schema), r in zip(SCHEMAS, responses):
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)
    wait_no_leaks(cluster)


def test_json_object_choice_and_regex(cluster, client):
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=64,
                                       messages=[{"role": "user", "content": "A cat as JSON."}],
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    choices = ["Paris", "London", "Berlin"]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": choices})
    assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, temperature=0.8, seed=3,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    wait_no_leaks(cluster)


def test_tool_call_round_trip(cluster, client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=48, messages=messages,
                                       tools=[WEATHER], tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    answer = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=messages,
                                            tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")
    wait_no_leaks(cluster)


def test_streamed_named_tool_call(cluster, client):
    stream = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=48, stream=True, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "Weather in Oslo, please."}])
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or ())]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    wait_no_leaks(cluster)


def test_bad_schema_is_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        _schema_request(client, "bad", {"type": "nope"})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"guided_regex": "a(b"})
    assert err.value.body["param"] == "guided_regex"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_regex_the_vocabulary_cannot_spell_is_400_and_leaks_nothing(cluster, client, temperature):
    """The fuzzer's find: after a few byte tokens no token may follow (no
    byte token continues the 4-byte character); that is the request's fault."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="-", max_tokens=8, temperature=temperature,
                                  extra_body={"guided_regex": "\u00d5\u00b4r\U0005069a."})
    assert "allows no next token" in err.value.body["message"]
    wait_no_leaks(cluster)
