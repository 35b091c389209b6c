"""vLLM's /tokenize and /detokenize: request models, and the work itself.

    POST /tokenize    {"model"?, "prompt": str, "add_special_tokens"?: true, "return_token_strs"?: false}
                   or {"model"?, "messages": [...], "add_generation_prompt"?: true,
                       "add_special_tokens"?: false, "return_token_strs"?: false}
                   -> {"count", "max_model_len", "tokens": [...], "token_strs"?: [...]}
    POST /detokenize  {"model"?, "tokens": [int]}  ->  {"prompt": str}

A body with ``messages`` is a chat; any other is a prompt.  The chat ids
with ``add_generation_prompt`` (the default) are exactly the prompt ids
/v1/chat/completions generates from.  Detokenizing keeps special tokens, so
tokenize -> detokenize gives back the text the ids stand for.

As on the generation routes: strict models (a wrong type or an unknown field
is a 400 naming it), a text that no context could hold refused by its length
alone (prompt.py's bound), ids outside the vocabulary refused, and large
inputs worked on in a worker thread, off the event loop.  A text under the
bound that tokenizes to more than ``max_model_len`` tokens is counted, not
refused: that count is what a client asks /tokenize for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from pdcluster.services.tokenizer import Tokenizer
from pdcluster.services.openai.errors import invalid_request, validation_error
from pdcluster.services.openai.intake import parse_body
from pdcluster.services.openai.input_size import TEMPLATE_CHARS_PER_MESSAGE
from pdcluster.services.openai.prompt import OFF_LOOP_PROMPT_SIZE, longest_token_chars
from pdcluster.services.openai.protocol import ChatMessage

T = TypeVar("T")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    add_generation_prompt: bool = True
    add_special_tokens: bool = False    # the chat template writes its own
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class _JSONObject(RootModel[dict[str, Any]]):
    pass


def parse_tokenize_request(body: bytes) -> TokenizeRequest:
    """The chat form when the body has ``messages``, else the prompt form."""
    obj = parse_body(body, _JSONObject).root
    kind: type[TokenizeRequest] = TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest
    try:
        req = kind.model_validate(obj)
    except ValidationError as exc:
        errors = list(exc.errors(include_url=False))
        first = errors[0] if errors else {}
        if first.get("loc") == ("prompt",) and first.get("type") not in ("missing", "extra_forbidden"):
            raise invalid_request("'prompt' must be a string (to tokenize a chat, send messages instead)",
                                  param="prompt", code="invalid_type") from None
        raise validation_error(errors) from None
    if isinstance(req, TokenizeChatRequest) and not req.messages:
        raise invalid_request("messages is empty: send at least one message", param="messages")
    return req


def _chars(req: TokenizeRequest) -> int:
    if isinstance(req, TokenizeChatRequest):
        return sum(len(m.template_dict()["content"]) for m in req.messages)
    return len(req.prompt)


async def _maybe_off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    if size > OFF_LOOP_PROMPT_SIZE:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def tokenize(tokenizer: Tokenizer, req: TokenizeRequest, max_model_len: int) -> list[int]:
    """The token ids of ``req``'s prompt or chat; a 400 for a text no context
    could hold (prompt.py's bound, without tokenizing it) or a chat the
    template refuses."""
    chars = _chars(req)
    if chars > max_model_len:   # every token stands for at least one character
        per_token = await asyncio.to_thread(longest_token_chars, tokenizer)   # a vocabulary pass, once
        if chars > max_model_len * per_token:
            what = "the messages hold" if isinstance(req, TokenizeChatRequest) else "the prompt has"
            raise invalid_request(
                f"{what} {chars} characters; this model's context is {max_model_len} tokens of at most "
                f"{per_token} characters each, {max_model_len * per_token} characters at most: shorten it",
                param="messages" if isinstance(req, TokenizeChatRequest) else "prompt",
                code="context_length_exceeded")
    if isinstance(req, TokenizeChatRequest):
        return await _maybe_off_loop(chars + TEMPLATE_CHARS_PER_MESSAGE * len(req.messages), _chat_ids,
                                     tokenizer, req)
    if not req.prompt:
        return []
    return await _maybe_off_loop(chars, tokenizer.encode, req.prompt, req.add_special_tokens)


def _chat_ids(tokenizer: Tokenizer, req: TokenizeChatRequest) -> list[int]:
    messages = [m.template_dict() for m in req.messages]
    try:
        if req.add_generation_prompt and not req.add_special_tokens:
            return tokenizer.apply_chat_template(messages)   # what /v1/chat/completions generates from
        if tokenizer.chat_template is None:
            raise ValueError("this model has no chat template; tokenize a plain prompt instead")
        text = tokenizer.render_chat(messages, add_generation_prompt=req.add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    except (TemplateError, ValueError) as exc:
        raise invalid_request(f"the chat template rejected these messages: {exc}", param="messages") from None


async def detokenize(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    """The text ``token_ids`` stand for, special tokens included; a 400 for
    an id outside the vocabulary."""
    return await _maybe_off_loop(len(token_ids), _detokenize, tokenizer, token_ids)


def _detokenize(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    vocab = tokenizer.vocab_size
    bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise invalid_request(f"tokens[{bad}] is {token_ids[bad]}, outside this model's vocabulary [0, {vocab}): "
                              "send ids that /tokenize returned", param="tokens", code="invalid_value")
    return tokenizer.decode(token_ids, skip_special_tokens=False)


async def token_strs(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    """Each id's token string (``return_token_strs``)."""
    return await _maybe_off_loop(len(token_ids), _token_strs, tokenizer, token_ids)


def _token_strs(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    return [t or "" for t in tokenizer.convert_ids_to_tokens(token_ids)]
