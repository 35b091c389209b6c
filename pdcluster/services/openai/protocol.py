"""Request models for /v1/completions and /v1/chat/completions, and their
conversion to the engine's ``SamplingParams``.

Strict on purpose: wrong JSON types are a 400 (no string-to-number
coercion), unknown fields are a 400 naming the field, and OpenAI features
this server does not implement are a 400 saying so -- never silently
ignored.  Ranges and caps are limits.py's: written there once, published in
these models' JSON schemas, enforced by ``limits.check_limits``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.sampling_params import SamplingParams, checked_fields
from pdcluster.services.openai.errors import OpenAIError, invalid_request
from pdcluster.services.openai.limits import (
    LOGIT_BIAS_SCHEMA,
    RANGES,
    STOP_LIST_SCHEMA,
    STOP_STRING_SCHEMA,
    STOP_TOKEN_IDS_SCHEMA,
    logit_bias_by_id,
)

T = TypeVar("T")

_NULL = {"type": "null"}
# The published schemas carry the bounds that limits.check_limits enforces.
Stop = Annotated[str | list[str] | None, WithJsonSchema({"anyOf": [STOP_STRING_SCHEMA, STOP_LIST_SCHEMA, _NULL]})]
PromptInput = Annotated[str | list[int], WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]})]
StopTokenIds = Annotated[list[int] | None, WithJsonSchema({"anyOf": [STOP_TOKEN_IDS_SCHEMA, _NULL]})]
LogitBias = Annotated[dict[str, float] | None, WithJsonSchema({"anyOf": [LOGIT_BIAS_SCHEMA, _NULL]})]


def _bounded(name: str, default: Any) -> Any:
    return Field(default, json_schema_extra=RANGES[name].schema())


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM extension: with include_usage, usage so far on every chunk


class _SamplingFields(_Strict):
    """Fields the two endpoints share."""
    model: str | None = None           # None: the (first) served model
    max_tokens: int | None = _bounded("max_tokens", None)
    temperature: float | None = _bounded("temperature", None)
    top_p: float | None = _bounded("top_p", None)
    seed: int | None = _bounded("seed", None)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None            # accepted for compatibility; not used
    presence_penalty: float = _bounded("presence_penalty", 0.0)
    frequency_penalty: float = _bounded("frequency_penalty", 0.0)
    logit_bias: LogitBias = None       # {"token id": bias}
    n: int = _bounded("n", 1)          # choices; they share the prompt's prefill (choices.py)
    # vLLM extensions
    ignore_eos: bool = False
    top_k: int | None = _bounded("top_k", None)   # 0 or -1: off
    stop_token_ids: StopTokenIds = None
    repetition_penalty: float | None = _bounded("repetition_penalty", None)  # None: 1, off
    min_tokens: int = _bounded("min_tokens", 0)
    priority: int = _bounded("priority", 0)   # lower is scheduled first; capped by the tenant's min_priority
    # vLLM's structured-output extensions (at most one, and not with response_format; structured.py)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None   # EBNF, xgrammar's dialect; start rule `root`


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    suffix: str | None = None
    # 0 only with echo: the prompt alone, scored (echo.py); the range check refuses it otherwise
    max_tokens: int | None = Field(None, json_schema_extra={"minimum": 0})
    echo: bool = False                 # the prompt before the text; with max_tokens 0, only the prompt
    best_of: int | None = _bounded("best_of", None)   # only equal to n (no server-side ranking)
    logprobs: int | None = _bounded("logprobs", None)  # alternatives per token; with echo, the prompt's too


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MessageToolCallFunction(_Strict):
    name: str
    arguments: str          # JSON text, as the model wrote it


class MessageToolCall(_Strict):
    """An earlier assistant turn's call, sent back in the conversation."""
    id: str
    type: Literal["function"] = "function"
    function: MessageToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None   # null only on an assistant turn with tool_calls
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None   # assistant turns
    tool_call_id: str | None = None               # tool turns: the call answered

    def template_dict(self) -> dict[str, str]:
        """What the chat template sees: text parts joined by newlines
        (tool calls are rendered by chat_messages.template_messages)."""
        content = self.content or ""
        text = content if isinstance(content, str) else "\n".join(p.text for p in content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = _bounded("max_completion_tokens", None)
    logprobs: bool = False
    top_logprobs: int | None = _bounded("top_logprobs", None)   # needs logprobs: true
    tools: list[dict[str, Any]] | None = None           # tools.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None             # accepted; one call per turn (tools.py)
    # Accepted only at values that mean "off":
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None       # structured.py


AnyRequest = CompletionRequest | ChatCompletionRequest


def _unsupported(param: str, what: str, fix: str = "remove it from the request") -> OpenAIError:
    message = f"{what} is not supported by this server; {fix}"
    return invalid_request(message, param=param, code="unsupported_parameter")


def reject_unsupported(req: AnyRequest) -> None:
    """Raise a 400 for any OpenAI feature asked for that this server does not
    implement.  Call after ``limits.check_limits``: a value out of range is
    refused as such, not as unsupported."""
    if req.stream_options is not None and not req.stream:
        raise invalid_request("stream_options is only allowed with stream: true", param="stream_options")
    if isinstance(req, CompletionRequest):
        _reject_unsupported_completion(req)
    else:
        _reject_unsupported_chat(req)


def _reject_unsupported_completion(req: CompletionRequest) -> None:
    if req.best_of is not None and req.best_of < req.n:
        raise invalid_request(f"best_of is {req.best_of}, less than n ({req.n}): best_of must be at least n",
                              param="best_of", code="invalid_value")
    if req.best_of not in (None, req.n):
        raise _unsupported("best_of", f"best_of={req.best_of} greater than n (ranking choices on the server)",
                           f"set best_of to n ({req.n}) and rank the choices by their logprobs yourself")
    if req.suffix is not None:
        raise _unsupported("suffix", "suffix (fill-in-the-middle)")


def _reject_unsupported_chat(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_request("top_logprobs requires logprobs: true; set logprobs, or remove top_logprobs",
                              param="top_logprobs", code="invalid_value")
    if req.functions:
        raise _unsupported("functions", "functions (the deprecated form of tools)", "send them as tools")
    if req.function_call not in (None, "none", "auto"):
        raise _unsupported("function_call", "function_call (the deprecated form of tool_choice)",
                           "send tool_choice instead")
    if not req.messages:
        raise invalid_request("messages is empty: send at least one message", param="messages")


def requested_max_tokens(req: AnyRequest) -> tuple[int | None, str]:
    """The client's output cap (None if unset) and the parameter it came from."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


_PARAMS_NAMED_IN_ERRORS = ("max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                           "logprobs")


def _logprob_kwargs(req: AnyRequest) -> dict[str, int | None]:
    """SamplingParams' logprobs (chat: top_logprobs alternatives when logprobs
    is true; completions: the count) and, for an echoed completion,
    prompt_logprobs."""
    if isinstance(req, ChatCompletionRequest):
        return {"logprobs": (req.top_logprobs or 0) if req.logprobs else None}
    return {"logprobs": req.logprobs, "prompt_logprobs": req.logprobs if req.echo else None}


def _min_tokens(req: AnyRequest, max_tokens: int) -> int:
    # Without a client cap, min_tokens counts up to the cap the server picks.
    return req.min_tokens if requested_max_tokens(req)[0] is not None else min(req.min_tokens, max_tokens)


def check_sampling_params(req: AnyRequest, max_tokens: int, max_tokens_param: str = "max_tokens") -> None:
    """Refuses, with a 400 naming the field, what ``to_sampling_params`` would refuse,
    without building the params: the HTTP layer calls it before rendering the prompt,
    and builds the request's one SamplingParams once the server has fitted max_tokens."""
    _checked(lambda: checked_fields(**_sampling_kwargs(req, max_tokens)), max_tokens_param)


def to_sampling_params(req: AnyRequest, max_tokens: int, max_tokens_param: str = "max_tokens",
                       **decided: Any) -> SamplingParams:
    """The one ``SamplingParams`` of ``req`` (validation errors become a 400 naming the
    field); ``decided``: what the gateway set (tenant, priority, guided)."""
    return _checked(lambda: SamplingParams(**(_sampling_kwargs(req, max_tokens) | decided)), max_tokens_param)


def _sampling_kwargs(req: AnyRequest, max_tokens: int) -> dict[str, Any]:
    top_k = req.top_k if req.top_k not in (None, -1) else 0
    min_tokens = _min_tokens(req, max_tokens)
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "top_k": top_k, "seed": req.seed,
                              "ignore_eos": req.ignore_eos,
                              "stop": () if req.stop is None else req.stop,
                              "stop_token_ids": tuple(req.stop_token_ids or ()),
                              "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
                              "logit_bias": logit_bias_by_id(req.logit_bias), "min_tokens": min_tokens,
                              "priority": req.priority,
                              **_logprob_kwargs(req)}
    if req.temperature is not None:
        kwargs["temperature"] = req.temperature
    if req.top_p is not None:
        kwargs["top_p"] = req.top_p
    if req.repetition_penalty is not None:
        kwargs["repetition_penalty"] = req.repetition_penalty
    return kwargs


def _checked(build: Callable[[], T], max_tokens_param: str) -> T:
    try:
        return build()
    except InvalidRequestError as exc:
        # SamplingParams starts every message with the field's name.
        message, field = str(exc), str(exc).split(" ", 1)[0]
        param = field if field in _PARAMS_NAMED_IN_ERRORS else None
        if param == "max_tokens" and max_tokens_param != "max_tokens":
            param, message = max_tokens_param, message.replace("max_tokens", max_tokens_param, 1)
        raise invalid_request(message, param=param, code="invalid_value") from exc
