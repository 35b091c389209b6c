"""Bounds on one request's inputs, so that no request can slow or break the
others sharing its gateway and engine: numeric ranges (as OpenAI sets them),
and caps on the work a request asks the engine to do on every token (stop
strings are scanned after each token of every running request).

Each bound is written once, in ``RANGES`` or the engine's caps; the request
models publish it in their JSON schema (``Range.schema``) and
``check_limits`` enforces it with a 400 naming the field and the bound.
Pydantic does not enforce them, so the message is ours, not pydantic's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.services.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
)
from pdcluster.services.openai.errors import invalid_request

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A logit_bias key is a token id written in decimal; 19 digits hold any int64.
# Choices per request (n): each is a decode of its own (choices.py).
MAX_CHOICES = 16
_MAX_TOKEN_ID_DIGITS = 19


@dataclass(frozen=True)
class Range:
    """``low <= x <= high`` (``low < x`` when ``low_open``); None: unbounded."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    note: str = ""          # what special values mean, said after the bound

    def __contains__(self, x: float) -> bool:
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return False
        return self.high is None or x <= self.high

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            text = (f"greater than {self.low} and at most {self.high}" if self.low_open
                    else f"between {self.low} and {self.high}")
        elif self.low is not None:
            text = f"greater than {self.low}" if self.low_open else f"at least {self.low}"
        else:
            text = f"at most {self.high}"
        return f"{text} ({self.note})" if self.note else text

    def schema(self) -> dict[str, Any]:
        """The bound as JSON-schema keywords (``json_schema_extra``)."""
        out: dict[str, Any] = {}
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        return out


MAX_PRIORITY = 1_000_000  # vLLM's priority field is any int; ours is bounded so it stays a small key

RANGES: dict[str, Range] = {
    "temperature": Range(0, 2, note="0 = greedy"),
    "top_p": Range(0, 1, low_open=True),
    "top_k": Range(-1, note="-1 or 0 = off"),
    "presence_penalty": Range(*PENALTY_RANGE, note="0 = off"),
    "frequency_penalty": Range(*PENALTY_RANGE, note="0 = off"),
    "repetition_penalty": Range(*REPETITION_PENALTY_RANGE, note="1 = off; above 1 discourages repeats"),
    "min_tokens": Range(0),
    "max_tokens": Range(1),
    "max_completion_tokens": Range(1),
    "n": Range(1, MAX_CHOICES),
    "best_of": Range(1, MAX_CHOICES),
    "logprobs": Range(0, MAX_LOGPROBS),       # completions' count (chat's is a bool: true is 1, in range)
    "top_logprobs": Range(0, MAX_LOGPROBS),
    "seed": Range(INT64_MIN, INT64_MAX, note="a signed 64-bit integer"),
    "priority": Range(-MAX_PRIORITY, MAX_PRIORITY, note="lower is more urgent; 0 by default"),
}

STOP_STRING_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}
STOP_LIST_SCHEMA = {"type": "array", "items": STOP_STRING_SCHEMA, "maxItems": MAX_STOP_STRINGS}
STOP_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
                         "maxItems": MAX_STOP_TOKEN_IDS}
LOGIT_BIAS_SCHEMA = {"type": "object", "propertyNames": {"pattern": f"^[0-9]{{1,{_MAX_TOKEN_ID_DIGITS}}}$"},
                     "additionalProperties": {"type": "number", "minimum": LOGIT_BIAS_RANGE[0],
                                              "maximum": LOGIT_BIAS_RANGE[1]},
                     "maxProperties": MAX_LOGIT_BIAS_ENTRIES}


def check_limits(req: Any) -> None:
    """A 400 for the first field of ``req`` (a completion or chat request)
    outside its range or over its cap."""
    for name, bound in RANGES.items():
        value = getattr(req, name, None)
        if value is not None and value not in bound:
            raise invalid_request(f"{name} is {value!r}, out of range: it must be {bound.describe()}",
                                  param=name, code="invalid_value")
    _check_stop(req.stop)
    _check_stop_token_ids(req.stop_token_ids)
    logit_bias_by_id(req.logit_bias)
    _check_min_tokens(req)


def _check_stop(stop: str | list[str] | None) -> None:
    strings = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if len(strings) > MAX_STOP_STRINGS:
        raise invalid_request(f"stop has {len(strings)} strings; the limit is {MAX_STOP_STRINGS}: "
                              "keep the stop strings that matter", param="stop", code="invalid_value")
    for i, s in enumerate(strings):
        if s == "":
            raise invalid_request("stop strings must be non-empty", param="stop", code="invalid_value")
        if len(s) > MAX_STOP_STRING_CHARS:
            where = "the stop string" if isinstance(stop, str) else f"stop[{i}]"
            raise invalid_request(f"{where} has {len(s)} characters; the limit is {MAX_STOP_STRING_CHARS}: "
                                  "shorten it", param="stop", code="invalid_value")


def _check_stop_token_ids(ids: list[int] | None) -> None:
    if ids is None:
        return
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise invalid_request(f"stop_token_ids has {len(ids)} ids; the limit is {MAX_STOP_TOKEN_IDS}: "
                              "keep the ids that matter", param="stop_token_ids", code="invalid_value")
    bad = next((t for t in ids if not 0 <= t <= INT64_MAX), None)
    if bad is not None:
        raise invalid_request(f"stop_token_ids holds {bad}, not a token id (0 to {INT64_MAX}): remove it",
                              param="stop_token_ids", code="invalid_value")


def logit_bias_by_id(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` keyed by int; a 400 for a key that is
    not a token id, a bias out of range, or too many entries.  Whether each
    id is in the model's vocabulary is the engine's check (a 400 too)."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid_request(f"logit_bias has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}: "
                              "keep the tokens that matter", param="logit_bias", code="invalid_value")
    low, high = LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= _MAX_TOKEN_ID_DIGITS):
            raise invalid_request(f"logit_bias key {key[:40]!r} is not a token id: keys must be token ids written "
                                  'as decimal strings, e.g. {"50256": -100}', param="logit_bias", code="invalid_value")
        if not low <= value <= high:
            raise invalid_request(f"logit_bias of token {key} is {value!r}, out of range: it must be between "
                                  f"{low:g} and {high:g}", param="logit_bias", code="invalid_value")
        token_id = int(key)
        if token_id in out:
            raise invalid_request(f"logit_bias names token {token_id} twice ({key!r}): give each token one bias",
                                  param="logit_bias", code="invalid_value")
        out[token_id] = value
    return out


def _check_min_tokens(req: Any) -> None:
    """min_tokens at most the output cap, when the client set one (without
    one, min_tokens counts up to the cap the server picks)."""
    name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    cap = getattr(req, name)
    if cap is not None and req.min_tokens > cap:
        raise invalid_request(f"min_tokens is {req.min_tokens}, more than {name} ({cap}): min_tokens must be at "
                              f"most {name}; lower it or raise {name}", param="min_tokens", code="invalid_value")
