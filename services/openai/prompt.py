"""From a validated request to what the backend needs: prompt token ids,
their block hashes, and a max_tokens that fits the context.

``prepare_prompt`` is all the CPU work (chat template, tokenization,
hashing) in one function, so it can move to a thread once prompts get long."""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError

from prefix_store.hashing import hash_prompt_blocks
from services.engine.tokenizer import Tokenizer
from services.openai.errors import invalid_request
from services.openai.protocol import AnyRequest, ChatCompletionRequest


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    block_hashes: tuple[int, ...]


def prepare_prompt(tokenizer: Tokenizer, req: AnyRequest, hash_seed: int, block_size: int) -> Prompt:
    ids = _token_ids(tokenizer, req)
    return Prompt(ids, tuple(hash_prompt_blocks(hash_seed, ids, block_size)))


def _token_ids(tokenizer: Tokenizer, req: AnyRequest) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        try:
            ids = tokenizer.apply_chat_template([m.template_dict() for m in req.messages])
        except (TemplateError, ValueError) as exc:
            raise invalid_request(f"the chat template rejected these messages: {exc}", param="messages") from None
    elif isinstance(req.prompt, str):
        ids = tokenizer.encode(req.prompt) if req.prompt else []
    else:
        ids = list(req.prompt)
        vocab = tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid_request(f"prompt token id {bad} is outside this model's vocabulary [0, {vocab})",
                                  param="prompt", code="invalid_value")
    if not ids:
        raise invalid_request("prompt is empty: send at least one token of text", param="prompt",
                              code="invalid_value")
    return ids


def prompt_param(req: AnyRequest) -> str:
    return "messages" if isinstance(req, ChatCompletionRequest) else "prompt"


def fit_max_tokens(req: AnyRequest, requested: int | None, max_tokens_param: str, num_prompt_tokens: int,
                   max_model_len: int, default_max_tokens: int | None) -> int:
    """The output cap to run with; a 400 naming both numbers when prompt plus
    cap cannot fit the context.  ``default_max_tokens`` None means "the rest
    of the context"."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise invalid_request(
            f"the prompt has {num_prompt_tokens} tokens; this model's context is {max_model_len} tokens "
            "and leaves no room for output: shorten the prompt",
            param=prompt_param(req), code="context_length_exceeded")
    if requested is None:
        return room if default_max_tokens is None else min(default_max_tokens, room)
    if requested > room:   # requested < 1 was already refused by SamplingParams
        raise invalid_request(
            f"the prompt has {num_prompt_tokens} tokens and {max_tokens_param} is {requested}, "
            f"together {num_prompt_tokens + requested}; this model's context is {max_model_len} tokens: "
            f"shorten the prompt or set {max_tokens_param} to at most {room}",
            param=max_tokens_param, code="context_length_exceeded")
    return requested
