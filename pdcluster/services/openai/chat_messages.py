"""A chat request's messages as the chat template sees them, tool turns
included.

    system/developer/user   their text (required)
    assistant               its text, then each of its tool_calls as the
                            call JSON the model is asked to write (tools.py),
                            one per line; text may be null when calls exist
    tool                    the tool's result text, role "tool" (needs
                            tool_call_id, as OpenAI's API does)

With tools on (tool_choice other than "none") their description goes into
the system prompt: appended to the first system/developer message, or as a
new first system message.  Rendering calls back in the very format the
grammar produces means the round trip (call, tool result, answer) shows
the model its own words."""

from __future__ import annotations

import json
from typing import Any

from pdcluster.services.openai.errors import OpenAIError, invalid_request
from pdcluster.services.openai.tools import tool_plan_of


def _bad(index: int, field: str, message: str) -> OpenAIError:
    return invalid_request(f"messages[{index}]: {message}", param=f"messages[{index}].{field}",
                           code="invalid_value")


def message_text(message: Any) -> str | None:
    content = message.content
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def check_messages(messages: list[Any]) -> None:
    """A 400 naming the message for a turn the template cannot render."""
    for i, m in enumerate(messages):
        text = message_text(m)
        if m.role != "assistant" and text is None:
            raise _bad(i, "content", f"a {m.role} message needs content")
        if m.tool_calls and m.role != "assistant":
            raise _bad(i, "tool_calls", "only assistant messages carry tool_calls")
        if m.role == "assistant" and text is None and not m.tool_calls:
            raise _bad(i, "content", "an assistant message needs content or tool_calls")
        if m.role == "tool" and not m.tool_call_id:
            raise _bad(i, "tool_call_id", "a tool message needs the tool_call_id of the call it answers")
        if m.tool_call_id is not None and m.role != "tool":
            raise _bad(i, "tool_call_id", "only tool messages carry tool_call_id")
        for j, call in enumerate(m.tool_calls or ()):
            _call_arguments(i, j, call)


def _call_arguments(i: int, j: int, call: Any) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        raise _bad(i, f"tool_calls[{j}].function.arguments", f"tool call arguments are not JSON ({exc})") from None


def render_call(name: str, arguments: Any) -> str:
    """One call as the model writes it (compact separators, as the grammar's)."""
    return json.dumps({"name": name, "arguments": arguments}, separators=(", ", ": "), ensure_ascii=False)


def template_messages(req: Any) -> list[dict[str, str]]:
    """What ``Tokenizer.apply_chat_template`` gets for ``req``."""
    check_messages(req.messages)
    out = []
    for i, m in enumerate(req.messages):
        text = message_text(m) or ""
        if m.tool_calls:
            calls = [render_call(c.function.name, _call_arguments(i, j, c)) for j, c in enumerate(m.tool_calls)]
            text = "\n".join(([text] if text else []) + calls)
        out.append({"role": m.role, "content": text})
    plan = tool_plan_of(req, check_grammars=False)   # constraint_of checked them, off the event loop
    system = plan.system_text() if plan is not None else None
    if system:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out
