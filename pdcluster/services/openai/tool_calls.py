"""From generated text to ``tool_calls``: the parser, and the chat format
that shapes a tool-using turn (whole, or streamed).

The grammar (tools.py) makes the rule simple: a turn whose text starts with
"{" is a call and, unless max_tokens cut it, parses as one; anything else is
plain text.  So a stream can pass text through as soon as its first
character is seen, and holds a call back until it is complete:

    text turn:  role chunk, content deltas ..., finish_reason "stop" | "length"
    call turn:  role chunk, one delta.tool_calls [{index 0, id, type, function:
                {name, arguments}}], finish_reason "tool_calls"
    cut call:   role chunk, the partial text as content, finish_reason "length"

``constraint_of`` is where a request's output constraint is decided: the
tools' grammar, or response_format / guided_*, never both."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from pdcluster.services.messages import TokenDelta
from pdcluster.services.guided_spec import GuidedSpec
from pdcluster.services.openai.errors import invalid_request
from pdcluster.services.openai.formats import ChatFormat, ChoiceTally, Tally
from pdcluster.services.openai.responses import (
    AssistantMessage, ChatCompletionResponse, ChatDelta, FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta,
)
from pdcluster.services.openai.structured import GUIDED_FIELDS, guided_spec_of
from pdcluster.services.openai.tools import ToolPlan, tool_plan_of


async def constraint_off_loop(req: Any) -> tuple[GuidedSpec | None, ToolPlan | None]:
    """``constraint_of`` in a worker thread when the request asks for one:
    building and checking a grammar (xgrammar) takes milliseconds for a small
    schema and far more for a big one, which must not hold the event loop
    every other stream's tokens go through."""
    if not asks_constraint(req):
        return None, None
    return await asyncio.to_thread(constraint_of, req)


def asks_constraint(req: Any) -> bool:
    """Whether any field that constrains the output (or names tools) is set;
    when none is, ``constraint_of`` is (None, None) without a check."""
    fields = ("response_format", "tools", "tool_choice", *GUIDED_FIELDS)
    return any(getattr(req, name, None) is not None for name in fields)


def constraint_of(req: Any) -> tuple[GuidedSpec | None, ToolPlan | None]:
    """The grammar a request's output follows (None: free text) and its tool
    plan (None: no tools); 400s for a bad schema, regex, tool or tool_choice."""
    guided = guided_spec_of(req)
    plan = tool_plan_of(req)
    if plan is None or not plan.may_call:
        return guided, plan
    if guided is not None:
        raise invalid_request("tools (with tool_choice other than \"none\") and response_format / guided_* both "
                              "constrain the output: send one of them", param="tool_choice", code="invalid_value")
    return plan.guided_spec(), plan


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str      # JSON text


def parse_call(text: str, plan: ToolPlan) -> ParsedCall | None:
    """The call ``text`` holds, or None when it is plain text (or a call cut short)."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return None
    try:
        obj = json.loads(stripped)
    except json.JSONDecodeError:
        return None
    names = {f.name for f in plan.callable_functions()}
    if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments"), dict):
        return None
    return ParsedCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class _ChoiceState:
    """One choice's stream: undecided until its first non-blank character."""
    is_call: bool | None = None
    pending: str = ""
    call_id: str = field(default_factory=new_call_id)


@dataclass(frozen=True)
class ToolCallFormat(ChatFormat):
    """ChatFormat for a request whose tools may be called."""
    plan: ToolPlan | None = None
    states: dict[int, _ChoiceState] = field(default_factory=dict, compare=False)

    @classmethod
    def around(cls, fmt: ChatFormat, plan: ToolPlan) -> "ToolCallFormat":
        return cls(**{f.name: getattr(fmt, f.name) for f in dataclasses.fields(fmt)}, plan=plan)

    def _event(self, chunk: TokenDelta, tally: Tally, c: ChoiceTally, first: bool) -> bytes:
        state = self.states.setdefault(chunk.index, _ChoiceState(True if self.plan.must_call else None))
        state.pending += chunk.text
        if state.is_call is None and state.pending.strip():
            state.is_call = state.pending.lstrip().startswith("{")
        if state.is_call is False:
            text, state.pending = state.pending, ""
            return super()._event(dataclasses.replace(chunk, text=text), tally, c, first)
        if chunk.finish_reason is None:
            return b""  # a call (or not yet known): held until it is complete
        call = parse_call(c.text, self.plan) if chunk.finish_reason == "stop" else None
        if call is None:
            text, state.pending = state.pending, ""
            return super()._event(dataclasses.replace(chunk, text=text), tally, c, first)
        delta = ChatDelta(tool_calls=[ToolCallDelta(index=0, id=state.call_id, type="function",
                                                    function=FunctionCallDelta(name=call.name,
                                                                               arguments=call.arguments))])
        return self._chunk(delta, None, chunk.index) + self._chunk(ChatDelta(), "tool_calls", chunk.index)

    def response(self, tally: Tally) -> ChatCompletionResponse:
        response = super().response(tally)
        for choice in response.choices:
            c = tally.choice(choice.index)
            call = parse_call(c.text, self.plan) if c.finish_reason == "stop" else None
            if call is not None:
                state = self.states.setdefault(choice.index, _ChoiceState())
                choice.message = AssistantMessage(content=None, tool_calls=[
                    ToolCall(id=state.call_id, function=FunctionCall(name=call.name, arguments=call.arguments))])
                choice.finish_reason = "tool_calls"
        return response
