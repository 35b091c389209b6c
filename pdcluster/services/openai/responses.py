"""Response and stream-chunk models, shaped as the OpenAI API returns them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from pdcluster.services.openai.logprobs_format import ChatLogprobs, CompletionLogprobs


def _omit_none():
    return Field(default=None, exclude_if=lambda v: v is None)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# -- /v1/completions --------------------------------------------------------------------------

class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Also the shape of each stream chunk (OpenAI uses the same object)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = _omit_none()


# -- /v1/chat/completions ---------------------------------------------------------------------

class FunctionCall(BaseModel):
    name: str
    arguments: str              # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None         # null when the turn is tool calls
    tool_calls: list[ToolCall] | None = _omit_none()


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = _omit_none()
    arguments: str | None = _omit_none()


class ToolCallDelta(BaseModel):
    index: int                  # which call of the turn (OpenAI streams calls by index)
    id: str | None = _omit_none()
    type: Literal["function"] | None = _omit_none()
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _omit_none()
    content: str | None = _omit_none()
    tool_calls: list[ToolCallDelta] | None = _omit_none()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = _omit_none()


# -- /v1/models -------------------------------------------------------------------------------

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- /tokenize, /detokenize (vLLM's shapes) ----------------------------------------------------

class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = _omit_none()   # with return_token_strs: true


class DetokenizeResponse(BaseModel):
    prompt: str


# -- errors -----------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body (see errors.OpenAIError.payload)."""
    error: ErrorDetail
