"""Every input counts toward the size bounds (issue 33): tool definitions and
tool-call arguments count toward the prompt's bound, tool schemas toward the
grammar's, before any template is rendered, grammar built or text
tokenized; a large chat is rendered and tokenized off the event loop."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from openai_fakes import FakeBackend, assert_openai_error, make_app

import pdcluster.services.openai.prompt as prompt_module
import pdcluster.services.openai.structured as structured_module
import pdcluster.services.openai.tools as tools_module
from pdcluster.services.guided_spec import MAX_GUIDED_SOURCE_CHARS
from pdcluster.services.openai.input_size import InputSize, input_size
from pdcluster.services.openai.prompt import OFF_LOOP_PROMPT_SIZE, longest_token_chars
from pdcluster.services.openai.protocol import ChatCompletionRequest

CC = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def tool(name: str, description: str = "a tool", parameters: dict | None = None) -> dict:
    fn = {"name": name, "description": description}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def wide_parameters(num_properties: int) -> dict:
    return {"type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(num_properties)}}


@pytest.fixture
def work_done(tokenizer, monkeypatch) -> dict[str, list]:
    """Thread ids of every encode (the chat template encodes through it), template render and grammar build."""
    calls: dict[str, list] = {"encode": [], "render": [], "grammar": []}
    real_encode, real_render = tokenizer.encode, prompt_module.template_messages
    real_check, real_union = tools_module.check_spec, tools_module._call_or_text_ebnf

    def spy(name, real):
        def wrapped(*args, **kwargs):
            calls[name].append(threading.get_ident())
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(tokenizer, "encode", spy("encode", real_encode))
    monkeypatch.setattr(prompt_module, "template_messages", spy("render", real_render))
    monkeypatch.setattr(tools_module, "check_spec", spy("grammar", real_check))
    monkeypatch.setattr(tools_module, "_call_or_text_ebnf", spy("grammar", real_union))
    return calls


def test_input_size_counts_messages_tool_calls_and_tools():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}], "tools": [tool("f")]})
    size = input_size(req)
    assert size == InputSize(message_chars=5 + 2, tool_call_chars=1 + 8,
                             tool_chars=len(json.dumps([tool("f")])), num_messages=3)
    assert size.chars == 7 + 9 + size.tool_chars and size.largest_param == "tools"


async def test_tools_over_the_prompt_bound_are_refused_before_rendering_or_any_grammar(client, backend, tokenizer,
                                                                                        work_done):
    limit = backend.max_model_len * longest_token_chars(tokenizer)
    tools = [tool(f"f{i}", "d" * (limit // 4)) for i in range(5)]     # a one-word message, tools past the bound
    err = assert_openai_error(await client.post(CC, json={"messages": HI, "tools": tools}), 400, "tools")
    assert err["code"] == "context_length_exceeded"
    assert all(s in err["message"] for s in (str(limit), "tools", "send fewer or shorter tools")), err["message"]
    assert work_done == {"encode": [], "render": [], "grammar": []} and backend.requests == []


async def test_tool_call_arguments_count_toward_the_prompt_bound(client, backend, tokenizer, work_done):
    limit = backend.max_model_len * longest_token_chars(tokenizer)
    arguments = json.dumps({"text": "a" * limit})
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "content": "ok", "tool_call_id": "c1"}]
    err = assert_openai_error(await client.post(CC, json={"messages": messages}), 400, "messages")
    assert err["code"] == "context_length_exceeded" and str(limit) in err["message"]
    assert work_done["encode"] == [] and work_done["render"] == [] and backend.requests == []


async def test_tool_schemas_over_the_grammar_bound_are_refused_before_any_is_compiled(tokenizer, work_done):
    # A context large enough that only the grammar's bound applies; a body limit that lets the tools in.
    backend = FakeBackend(max_model_len=8192)
    app = make_app(backend, tokenizer, max_body_bytes=4 * MAX_GUIDED_SOURCE_CHARS)
    tools = [tool(f"f{i}", parameters=wide_parameters(400)) for i in range(16)]   # ~10 KB of schema each
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        for choice in ("auto", "required", "none"):
            r = await client.post(CC, json={"messages": HI, "tools": tools, "tool_choice": choice})
            err = assert_openai_error(r, 400, "tools")
            assert str(MAX_GUIDED_SOURCE_CHARS) in err["message"] and "send fewer tools" in err["message"]
    assert work_done == {"encode": [], "render": [], "grammar": []} and backend.requests == []


async def test_the_auto_grammar_over_the_bound_names_tools(tokenizer):
    # Call schemas under the bound whose "auto" grammar (call or text) comes out over it: a 400 naming tools.
    backend = FakeBackend(max_model_len=32768)     # room for the tools' system prompt once they are accepted
    app = make_app(backend, tokenizer, max_body_bytes=4 * MAX_GUIDED_SOURCE_CHARS)
    tools = [tool(f"f{i}", parameters=wide_parameters(250)) for i in range(8)]
    assert sum(len(json.dumps(t)) for t in tools) < MAX_GUIDED_SOURCE_CHARS
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        err = assert_openai_error(await client.post(CC, json={"messages": HI, "tools": tools}), 400, "tools")
        assert str(MAX_GUIDED_SOURCE_CHARS) in err["message"] and "grammar" in err["message"]
        r = await client.post(CC, json={"messages": HI, "tools": tools, "tool_choice": "required"})
        assert r.status_code == 200, r.text          # the plain call schema fits
    assert len(backend.requests) == 1


async def test_a_chat_with_large_tools_is_rendered_and_tokenized_off_the_event_loop(client, backend, work_done):
    loop_thread = threading.get_ident()
    tools = [tool("lookup", "d" * OFF_LOOP_PROMPT_SIZE)]     # one short message, a large system prompt
    r = await client.post(CC, json={"messages": HI, "tools": tools, "max_tokens": 1})
    assert r.status_code in (200, 400), r.text              # 400: longer than the fake's context, once tokenized
    assert work_done["render"] and work_done["encode"]
    assert loop_thread not in work_done["render"] + work_done["encode"]
    small = await client.post(CC, json={"messages": HI, "tools": [tool("lookup")], "max_tokens": 1})
    assert small.status_code == 200 and work_done["render"][-1] == loop_thread   # small chats stay on the loop


@pytest.mark.parametrize("field", ["response_format", "guided_json"])
async def test_a_schema_over_the_grammar_bound_is_refused_before_it_is_compiled(tokenizer, monkeypatch, field):
    built = []
    real = structured_module.check_spec
    monkeypatch.setattr(structured_module, "check_spec", lambda *a: built.append(a) or real(*a))
    backend = FakeBackend(max_model_len=8192)
    app = make_app(backend, tokenizer, max_body_bytes=4 * MAX_GUIDED_SOURCE_CHARS)
    schema = wide_parameters(MAX_GUIDED_SOURCE_CHARS // 20)
    value = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}} if field == "response_format" \
        else schema
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        err = assert_openai_error(await client.post(CC, json={"messages": HI, field: value}), 400, field)
    assert str(MAX_GUIDED_SOURCE_CHARS) in err["message"] and built == [] and backend.requests == []
