"""Structured output and tools at the HTTP layer (scripted backend): what
grammar each form becomes, the 400s, the tool-call response and stream
shapes, and tool turns rendered into the prompt."""

from __future__ import annotations

import json

import pytest
from openai_fakes import CHAT, MODEL, assert_openai_error, sse_events

from pdcluster.services.openai.chat_messages import template_messages
from pdcluster.services.openai.protocol import ChatCompletionRequest
from pdcluster.services.openai.tool_calls import parse_call
from pdcluster.services.openai.tools import tool_plan_of

C, CC = "/v1/completions", "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_PIECES = ['{"', 'name', '": "', 'get_weather', '", "', 'arguments', '": {"', 'city', '": "', 'Paris', '"}}']


def _chat(**extra) -> dict:
    return {"model": MODEL, "messages": CHAT, **extra}


@pytest.mark.parametrize("extra, kind, source_has", [
    ({"response_format": {"type": "json_object"}}, "json_schema", '"object"'),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}, "strict": True}}},
     "json_schema", '"a"'),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}}}, "json_schema", "boolean"),
    ({"guided_json": '{"enum": ["x", "y"]}'}, "json_schema", "enum"),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"guided_choice": ["yes", "no", 'a "quoted" one']}, "ebnf", '"a \\"quoted\\" one"'),
    ({"guided_grammar": 'root ::= "a" | "b"'}, "ebnf", '"a"'),
    ({"response_format": {"type": "text"}}, None, None),
])
async def test_each_form_becomes_one_grammar(client, backend, extra, kind, source_has):
    r = await client.post(CC, json=_chat(**extra))
    assert r.status_code == 200, r.text
    guided = backend.requests[0].params.guided
    if kind is None:
        assert guided is None
    else:
        assert guided.kind == kind and source_has in guided.source


async def test_guided_extensions_work_on_completions(client, backend):
    r = await client.post(C, json={"model": MODEL, "prompt": "Hi", "guided_choice": ["a", "b"]})
    assert r.status_code == 200, r.text
    assert backend.requests[0].params.guided.source == 'root ::= "a" | "b"'


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["ok", ""]}, "guided_choice"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
async def test_bad_constraints_are_400_naming_the_field(client, backend, extra, param):
    assert_openai_error(await client.post(CC, json=_chat(**extra)), 400, param)
    assert backend.requests == []


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"guided_regex": "[0-9]+"},
    {"tools": [WEATHER], "tool_choice": "required"},
])
async def test_grammar_checks_run_off_the_event_loop(client, backend, monkeypatch, extra):
    """Building a grammar (xgrammar) can take seconds for a big schema: the
    gateway's check of it must not hold the event loop every stream shares."""
    import threading

    from pdcluster.services.openai import structured

    checked_on: list[threading.Thread] = []
    real = structured._grammar_error

    def recording(spec):
        checked_on.append(threading.current_thread())
        return real(spec)

    monkeypatch.setattr(structured, "_grammar_error", recording)
    r = await client.post(CC, json=_chat(**extra))
    assert r.status_code == 200, r.text
    assert checked_on and threading.main_thread() not in checked_on


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "assistant"}], "messages[0].content"),
    ([{"role": "tool", "content": "22C"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
])
async def test_bad_tool_turns_are_400(client, backend, messages, param):
    assert_openai_error(await client.post(CC, json={"model": MODEL, "messages": messages}), 400, param)


def test_tool_round_trip_renders_the_call_and_the_result():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C and sunny"}], "tools": [WEATHER]})
    rendered = template_messages(req)
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant",
                           "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'}
    assert rendered[3] == {"role": "tool", "content": "22C and sunny"}


def test_tool_choice_none_hides_the_tools_and_sets_no_grammar():
    req = ChatCompletionRequest.model_validate({"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"})
    plan = tool_plan_of(req)
    assert plan.guided_spec() is None and plan.system_text() is None
    assert template_messages(req)[0] == CHAT[0]


def test_required_is_the_call_schema_and_auto_a_union_with_text():
    req = ChatCompletionRequest.model_validate({"messages": CHAT, "tools": [WEATHER], "tool_choice": "required"})
    spec = tool_plan_of(req).guided_spec()
    assert spec.kind == "json_schema" and json.loads(spec.source)["properties"]["name"] == {"enum": ["get_weather"]}
    req = ChatCompletionRequest.model_validate({"messages": CHAT, "tools": [WEATHER]})
    assert tool_plan_of(req).guided_spec().kind == "ebnf"


def test_parse_call():
    plan = tool_plan_of(ChatCompletionRequest.model_validate({"messages": CHAT, "tools": [WEATHER]}))
    assert parse_call('{"name": "get_weather", "arguments": {"city": "Oslo"}}', plan).arguments == '{"city": "Oslo"}'
    assert parse_call("It is sunny.", plan) is None
    assert parse_call('{"name": "get_weather", "arguments": {"ci', plan) is None
    assert parse_call('{"name": "other", "arguments": {}}', plan) is None


async def test_a_call_is_returned_as_tool_calls(client, backend):
    backend.script.pieces = CALL_PIECES
    r = await client.post(CC, json=_chat(tools=[WEATHER], tool_choice="required"))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


async def test_auto_text_is_plain_content(client, backend):
    r = await client.post(CC, json=_chat(tools=[WEATHER]))
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello, world!"}
    assert choice["finish_reason"] == "stop"


async def test_a_call_cut_by_max_tokens_is_content_with_length(client, backend):
    backend.script.pieces = CALL_PIECES
    r = await client.post(CC, json=_chat(tools=[WEATHER], max_tokens=4))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "".join(CALL_PIECES[:4])


async def test_streamed_call_arrives_as_a_tool_calls_delta(client, backend):
    backend.script.pieces = CALL_PIECES
    r = await client.post(CC, json=_chat(tools=[WEATHER], stream=True))
    events = sse_events(r.text)
    deltas = [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]
    calls = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    assert calls[0][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert not any(d["delta"].get("content") for d in deltas)
    assert deltas[-1]["finish_reason"] == "tool_calls"


async def test_streamed_auto_text_passes_through(client, backend):
    r = await client.post(CC, json=_chat(tools=[WEATHER], stream=True))
    deltas = [e["choices"][0] for e in sse_events(r.text) if isinstance(e, dict) and e.get("choices")]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Hello, world!"
    assert deltas[-1]["finish_reason"] == "stop"
