"""Structured output at the gateway: ``response_format`` (OpenAI) and the
``guided_*`` extensions (vLLM) become one ``GuidedSpec``, or a 400 naming
the field.

    response_format {"type": "text"}                      -> none
    response_format {"type": "json_object"}               -> json_schema {"type": "object"}
    response_format {"type": "json_schema",
                     "json_schema": {name, schema, strict}} -> json_schema <schema>
    guided_json <schema object or JSON text>              -> json_schema <schema>
    guided_regex <pattern>                                -> regex <pattern>
    guided_choice [<string>, ...]                         -> ebnf  root ::= "a" | "b" ...
    guided_grammar <EBNF, xgrammar's dialect>             -> ebnf  <grammar>

At most one of them per request.  Each spec is checked here by building
its grammar (xgrammar, no tokenizer needed: ~1 ms for a small schema, and
the outcome is cached per distinct spec), so a bad schema or regex is a 400
before any replica sees it; the replicas compile it against the vocabulary
once per spec (pdcluster/services/engine/grammar.py).  Generation is always strict:
only the declared properties, compact separators (see grammar.py), which
validates against the schema whether or not the client asked for strict."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.guided_spec import GuidedSpec
from pdcluster.services.openai.errors import OpenAIError, invalid_request

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_CHOICES = 256
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
JSON_OBJECT_SCHEMA = '{"type":"object"}'


def _bad(param: str, message: str) -> OpenAIError:
    return invalid_request(message, param=param, code="invalid_value")


def guided_spec_of(req: Any) -> GuidedSpec | None:
    """The request's output constraint (None: free text); a 400 naming the
    field for a malformed, unsupported or uncompilable one."""
    asked = [name for name in GUIDED_FIELDS if getattr(req, name, None) is not None]
    response_format = getattr(req, "response_format", None)
    if response_format is not None and _format_type(response_format) != "text":
        asked.insert(0, "response_format")
    if len(asked) > 1:
        raise _bad(asked[1], f"{' and '.join(asked)} each constrain the output; send only one of them")
    if not asked:
        return None
    param = asked[0]
    spec = _spec(param, response_format if param == "response_format" else getattr(req, param))
    # json_object always compiles: a response_format that fails is a json_schema's schema.
    check_spec(spec, "response_format.json_schema.schema" if param == "response_format" else param)
    return spec


def _format_type(response_format: Any) -> str:
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise _bad("response_format", 'response_format must be an object with a "type": "text", '
                                      '"json_object" or "json_schema"')
    return response_format["type"]


def _spec(param: str, value: Any) -> GuidedSpec:
    try:
        if param == "response_format":
            return _response_format_spec(value)
        if param == "guided_json":
            return GuidedSpec("json_schema", schema_text(param, value))
        if param == "guided_regex":
            if not isinstance(value, str) or not value:
                raise _bad(param, "guided_regex must be a non-empty string (a regular expression)")
            return GuidedSpec("regex", value)
        if param == "guided_choice":
            return GuidedSpec("ebnf", choice_grammar(value))
        if not isinstance(value, str) or not value.strip():
            raise _bad(param, "guided_grammar must be a non-empty EBNF grammar whose start rule is `root`")
        return GuidedSpec("ebnf", value)
    except InvalidRequestError as exc:  # GuidedSpec's own limits
        raise _bad(param, f"{param}: {exc}") from None


def _response_format_spec(fmt: dict) -> GuidedSpec:
    kind = fmt["type"]
    if kind == "json_object":
        _only_keys(fmt, {"type"}, "response_format")
        return GuidedSpec("json_schema", JSON_OBJECT_SCHEMA)
    if kind != "json_schema":
        raise _bad("response_format", f'response_format type {kind!r} is not one of "text", "json_object", '
                                      '"json_schema"')
    _only_keys(fmt, {"type", "json_schema"}, "response_format")
    js = fmt.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(js, dict):
        raise _bad(param, 'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
    _only_keys(js, {"name", "schema", "strict", "description"}, param)
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise _bad(f"{param}.name", "json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise _bad(f"{param}.strict", "json_schema.strict must be a boolean")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise _bad(f"{param}.description", "json_schema.description must be a string")
    schema = js.get("schema", {"type": "object"})
    return GuidedSpec("json_schema", schema_text(f"{param}.schema", schema))


def _only_keys(obj: dict, allowed: set[str], param: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise _bad(param, f"{param} has unknown field(s) {', '.join(extra)}; allowed: {', '.join(sorted(allowed))}")


def schema_text(param: str, schema: Any) -> str:
    """A JSON schema (object, or its JSON text) as compact JSON text; property order kept."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise _bad(param, f"{param} is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise _bad(param, f"{param} must be a JSON schema object, got a JSON {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def choice_grammar(choices: Any) -> str:
    """``root ::= "a" | "b" ...``: exactly one of the strings."""
    if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)):
        raise _bad("guided_choice", f"guided_choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
    return "root ::= " + " | ".join(ebnf_literal(c) for c in dict.fromkeys(choices))


def ebnf_literal(text: str) -> str:
    """A string literal in xgrammar's EBNF: JSON's escapes, characters as themselves."""
    return json.dumps(text, ensure_ascii=False)


def check_spec(spec: GuidedSpec, param: str) -> None:
    """A 400 naming ``param`` when the grammar library refuses the spec."""
    why = _grammar_error(spec)
    if why is not None:
        raise _bad(param, f"{param} is not a valid {spec.kind.replace('_', ' ')}: {why}")


@functools.lru_cache(maxsize=512)
def _grammar_error(spec: GuidedSpec) -> str | None:
    """Why the grammar of ``spec`` cannot be built, or None (cached per spec)."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.source, any_whitespace=False, strict_mode=True)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.source)
        else:
            xgr.Grammar.from_ebnf(spec.source)
    except (RuntimeError, ValueError, TypeError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
    return None
