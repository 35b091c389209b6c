"""How big a request's inputs are, counted before any of them is rendered,
compiled or tokenized.  Every input that reaches the prompt counts toward
the prompt's bound (prompt.py) and toward the choice to work on it off the
event loop, not only the message text:

    messages      each message's text (a completion's prompt string)
    tool calls    each earlier assistant call's name and argument JSON, as sent
    tools         the tool definitions as JSON text, as sent: the system
                  prompt shows each one's name, description and parameters
                  (tools.py), so this is a little more than the model sees.
                  Counted with tool_choice "none" too: they are parsed and
                  checked all the same.

``response_format`` and ``guided_*`` never reach the prompt; their bound is
the grammar source's (``MAX_GUIDED_SOURCE_CHARS``), checked before they are
compiled (structured.py, tools.py).

Counting is one ``json.dumps`` of the tools (C code) plus a sum over the
messages: a body at the size limit costs the event loop a few milliseconds,
where rendering and tokenizing it cost it about a second."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# About what a chat template adds around each message; it counts toward the
# work of rendering a chat with many short messages.
TEMPLATE_CHARS_PER_MESSAGE = 32


@dataclass(frozen=True)
class InputSize:
    message_chars: int = 0
    tool_call_chars: int = 0
    tool_chars: int = 0
    num_messages: int = 0
    num_token_ids: int = 0      # a completion prompt sent as token ids

    @property
    def chars(self) -> int:
        """Characters of text bound for the prompt."""
        return self.message_chars + self.tool_call_chars + self.tool_chars

    @property
    def work(self) -> int:
        """How much CPU rendering and tokenizing will cost, in characters or token ids."""
        return self.chars + TEMPLATE_CHARS_PER_MESSAGE * self.num_messages + self.num_token_ids

    @property
    def largest_param(self) -> str:
        """The request field that holds most of the text: where to shorten first."""
        if self.num_messages == 0:
            return "prompt"
        return "tools" if self.tool_chars > self.message_chars + self.tool_call_chars else "messages"

    def describe(self) -> str:
        """``"41000 characters (messages 2, tool calls 0, tools 40998)"``; the parts only when there are tools or calls."""
        if not (self.tool_chars or self.tool_call_chars):
            return f"{self.chars} characters"
        return (f"{self.chars} characters (messages {self.message_chars}, tool calls {self.tool_call_chars}, "
                f"tools {self.tool_chars})")


def input_size(req: Any) -> InputSize:
    """The size of a completion or chat request's prompt inputs (see the module docstring)."""
    messages = getattr(req, "messages", None)
    if messages is None:
        prompt = req.prompt
        return InputSize(message_chars=len(prompt)) if isinstance(prompt, str) else InputSize(num_token_ids=len(prompt))
    message_chars = tool_call_chars = 0
    for m in messages:
        content = m.content
        if isinstance(content, str):
            message_chars += len(content)
        elif content is not None:
            message_chars += sum(len(part.text) for part in content) + max(len(content) - 1, 0)  # joined by newlines
        for call in m.tool_calls or ():
            tool_call_chars += len(call.function.name) + len(call.function.arguments)
    tools = getattr(req, "tools", None)
    tool_chars = len(json.dumps(tools, ensure_ascii=False)) if tools else 0
    return InputSize(message_chars, tool_call_chars, tool_chars, len(messages))
