"""Tool calling for models whose chat template has no tool format (the
default SmolLM2 has none): the tools are described in the system prompt,
and the grammar decides what a call looks like.

A call is one JSON object, the same text in the prompt's instructions, in
the grammar, in the parser (tool_calls.py) and when an earlier call is
rendered back into the conversation (chat_messages.py)::

    {"name": "<function name>", "arguments": {<the function's parameters>}}

tool_choice -> what generation may produce:

    "none"            free text; the tools are not shown to the model
    "auto" (default)  EITHER a call (starts with "{", then exactly the call
                      schema) OR plain text (starts with anything but "{"
                      or whitespace, then free); one grammar, the union
    "required"        a call to one of the tools (the call schema: anyOf
                      over the tools, each with its name as a one-value enum)
    {"type": "function", "function": {"name": N}}   a call to N

Why "auto" is a grammar and not a JSON envelope: plain answers stay plain
text (a 135M model writes worse prose inside a JSON string, and a stream of
text would only reach the client after the envelope closed), yet the moment
the model opens a call, every further token is held to the call schema, so
a call always parses and validates.  The model's first character decides,
which also makes the stream unambiguous: "{" is a call, anything else is
text.  One call per turn (``parallel_tool_calls`` is accepted; the grammar
admits one object)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pdcluster.services.guided_spec import MAX_GUIDED_SOURCE_CHARS, GuidedSpec
from pdcluster.services.openai.errors import OpenAIError, invalid_request
from pdcluster.services.openai.structured import check_spec

MAX_TOOLS = 128
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Plain text in "auto": anything that does not open a call.
_TEXT_EBNF = 'root ::= [^{ \\t\\n\\r] [^]*'
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str
    parameters: dict[str, Any]

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one call to this function."""
        return {"type": "object", "properties": {"name": {"enum": [self.name]}, "arguments": self.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its response."""
    functions: tuple[ToolFunction, ...]
    choice: str                     # "none" | "auto" | "required" | "function"
    forced_name: str | None = None  # choice "function": the one to call

    @property
    def may_call(self) -> bool:
        return self.choice != "none"

    @property
    def must_call(self) -> bool:
        return self.choice in ("required", "function")

    def callable_functions(self) -> tuple[ToolFunction, ...]:
        if self.forced_name is None:
            return self.functions
        return tuple(f for f in self.functions if f.name == self.forced_name)

    def call_schema(self) -> dict[str, Any]:
        schemas = [f.call_schema() for f in self.callable_functions()]
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}

    def guided_spec(self) -> GuidedSpec | None:
        """The grammar generation follows (None for "none"); its size is
        checked before it is built (the "auto" grammar is built from the
        call schema, and comes out larger than it)."""
        if not self.may_call:
            return None
        schema = _tools_grammar("json_schema", json.dumps(self.call_schema(), separators=(",", ":"),
                                                          ensure_ascii=False))
        spec = schema if self.must_call else _tools_grammar("ebnf", _call_or_text_ebnf(schema.source))
        check_spec(spec, "tools")
        return spec

    def system_text(self) -> str | None:
        """The instructions and tool list for the system prompt (None for "none")."""
        if not self.may_call:
            return None
        shown = [{"name": f.name, "description": f.description, "parameters": f.parameters}
                 for f in self.functions]
        lines = ["# Tools", "", "You can call these functions:", json.dumps(shown, ensure_ascii=False), "",
                 'To call a function, reply with only a JSON object: {"name": "<function name>", '
                 '"arguments": {<arguments as the function\'s parameters say>}}.']
        if self.choice == "auto":
            lines.append("If no function is needed, answer in plain text.")
        elif self.choice == "required":
            lines.append("You must call one of these functions now.")
        else:
            lines.append(f"You must call the function {self.forced_name} now.")
        return "\n".join(lines)


def _call_or_text_ebnf(call_schema: str) -> str:
    """One grammar: a call to one of the tools, or plain text (see the module docstring)."""
    import xgrammar as xgr

    call = xgr.Grammar.from_json_schema(call_schema, any_whitespace=False, strict_mode=True)
    return str(xgr.Grammar.union(call, xgr.Grammar.from_ebnf(_TEXT_EBNF)))


def _bad(param: str, message: str) -> OpenAIError:
    return invalid_request(message, param=param, code="invalid_value")


def _tools_too_big(what: str, chars: int) -> OpenAIError:
    return _bad("tools", f"{what} {chars} characters; the limit is {MAX_GUIDED_SOURCE_CHARS} (one grammar holds "
                         "every tool's call): send fewer tools, or shorter parameter schemas")


def _tools_grammar(kind: str, source: str) -> GuidedSpec:
    if len(source) > MAX_GUIDED_SOURCE_CHARS:
        raise _tools_too_big(f"the tools' call grammar ({kind.replace('_', ' ')}) has", len(source))
    return GuidedSpec(kind, source)


def tool_plan_of(req: Any, check_grammars: bool = True) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (400 naming the field);
    None when it has no tools.  ``check_grammars`` False skips building each
    tool's grammar (xgrammar): for a request whose tools ``constraint_of``
    already checked, off the event loop (the prompt's rendering)."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "tool_choice needs tools: send the tools, or remove tool_choice")
        if tools is not None:
            raise _bad("tools", "tools is empty: send at least one tool, or remove tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"tools has {len(tools)} entries; the limit is {MAX_TOOLS}")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise _bad("tools", "two tools have the same function name: give each a unique name")
    # Sized before any is compiled: together they make one grammar (ToolPlan.guided_spec).
    schemas = [_call_schema_text(f) for f in functions]
    if sum(map(len, schemas)) > MAX_GUIDED_SOURCE_CHARS:
        raise _tools_too_big("the tools' call schemas together have", sum(map(len, schemas)))
    for i, schema in enumerate(schemas if check_grammars else ()):
        check_spec(GuidedSpec("json_schema", schema), f"tools[{i}].function.parameters")
    kind, forced = _choice(choice, names)
    return ToolPlan(functions, kind, forced)


def _function(i: int, tool: Any) -> ToolFunction:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(param, f'{param} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
    if set(tool) - {"type", "function"}:
        raise _bad(param, f"{param} has unknown field(s) {', '.join(sorted(set(tool) - {'type', 'function'}))}")
    fn = tool["function"]
    extra = set(fn) - {"name", "description", "parameters", "strict"}
    if extra:
        raise _bad(f"{param}.function", f"{param}.function has unknown field(s) {', '.join(sorted(extra))}")
    name = fn.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise _bad(f"{param}.function.name", "a function name must be 1-64 characters of a-z, A-Z, 0-9, _ or -")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise _bad(f"{param}.function.description", "a function description must be a string")
    parameters = fn.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise _bad(f"{param}.function.parameters", "function parameters must be a JSON schema object")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise _bad(f"{param}.function.strict", "function strict must be a boolean")
    return ToolFunction(name, description, parameters)


def _call_schema_text(function: ToolFunction) -> str:
    return json.dumps(function.call_schema(), separators=(",", ":"), ensure_ascii=False)


def _choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise _bad("tool_choice", f"tool_choice names function {name!r}, which is not among the tools "
                                      f"({', '.join(names)})")
        return "function", name
    raise _bad("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}')
