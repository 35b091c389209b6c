"""From a validated request to what the backend needs: prompt token ids,
their block hashes, and a max_tokens that fits the context.

``prepare_prompt`` is all the CPU work (chat template, tokenization,
hashing) in one function.  ``check_prompt_fits`` first refuses a prompt that
can never fit (by its length alone, without tokenizing it: every input that
reaches the prompt counts, tools and tool-call arguments too, input_size.py);
the route calls it before any grammar is built.  ``prompt_for`` then runs
that work in a worker thread when the inputs are large, so one big request
never stalls the other streams on the gateway's event loop.

The bound without tokenizing: no token of a vocabulary stands for more
characters of input than its own token string has (byte-level BPE spells
each byte as one character, SentencePiece spells text as itself and a byte
as ``<0xNN>``), so a prompt needs at least ``chars / longest_token_chars``
tokens, and more than ``max_model_len * longest_token_chars`` characters can
never fit."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from jinja2 import TemplateError

from pdcluster.prefix_store.hashing import hash_prompt_blocks
from pdcluster.services.tokenizer import Tokenizer
from pdcluster.services.openai.chat_messages import template_messages
from pdcluster.services.openai.errors import OpenAIError, invalid_request
from pdcluster.services.openai.input_size import InputSize, input_size
from pdcluster.services.openai.protocol import AnyRequest, ChatCompletionRequest

# Inputs bigger than this (InputSize.work: characters, or token ids) are
# rendered, tokenized and hashed in a worker thread: ~1 ms of CPU, the most
# one request may hold the loop.
OFF_LOOP_PROMPT_SIZE = 4096

_LONGEST_TOKEN_CHARS: WeakKeyDictionary[Tokenizer, int] = WeakKeyDictionary()


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    block_hashes: tuple[int, ...]


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The length in characters of the longest token string in this
    tokenizer's vocabulary (special tokens included); computed once per
    tokenizer, on first use."""
    chars = _LONGEST_TOKEN_CHARS.get(tokenizer)
    if chars is None:
        tokens = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
        chars = max((len(t) for t in tokens if t), default=1)
        _LONGEST_TOKEN_CHARS[tokenizer] = chars
    return chars


async def check_prompt_fits(tokenizer: Tokenizer, req: AnyRequest, max_model_len: int) -> InputSize:
    """``check_prompt_length``, the vocabulary pass it may need run off the
    event loop; the request's input size, for ``prompt_for``."""
    size = input_size(req)
    if size.chars > max_model_len and tokenizer not in _LONGEST_TOKEN_CHARS:
        await asyncio.to_thread(longest_token_chars, tokenizer)   # a pass over the vocabulary, once
    check_prompt_length(tokenizer, req, max_model_len, size)
    return size


async def prompt_for(tokenizer: Tokenizer, req: AnyRequest, max_model_len: int, hash_seed: int,
                     block_size: int, size: InputSize | None = None) -> Prompt:
    """``prepare_prompt`` after ``check_prompt_fits`` (``size``: what it
    returned, when the caller ran it already); off the event loop when the
    inputs are large."""
    if size is None:
        size = await check_prompt_fits(tokenizer, req, max_model_len)
    if size.work > OFF_LOOP_PROMPT_SIZE:
        return await asyncio.to_thread(prepare_prompt, tokenizer, req, hash_seed, block_size)
    return prepare_prompt(tokenizer, req, hash_seed, block_size)


def check_prompt_length(tokenizer: Tokenizer, req: AnyRequest, max_model_len: int,
                        size: InputSize | None = None) -> None:
    """A 400 for a prompt that can never fit the context, without tokenizing
    it: its text, tools and tool calls counted together (input_size.py)."""
    if not isinstance(req, ChatCompletionRequest) and isinstance(req.prompt, list):
        if len(req.prompt) >= max_model_len:
            raise _no_room_for_output(req, len(req.prompt), max_model_len)
        return
    size = input_size(req) if size is None else size
    if size.chars <= max_model_len:      # every token stands for at least one character
        return
    per_token = longest_token_chars(tokenizer)
    limit = max_model_len * per_token
    if size.chars <= limit:
        return
    context = (f"this model's context is {max_model_len} tokens of at most {per_token} characters each, "
               f"{limit} characters at most")
    if not isinstance(req, ChatCompletionRequest):
        message = f"the prompt has {size.describe()}; {context}: shorten the prompt"
    elif size.tool_chars or size.tool_call_chars:
        fix = ("send fewer or shorter tools" if size.largest_param == "tools"
               else "shorten the messages and their tool calls' arguments")
        message = (f"the messages, tool calls and tools hold {size.describe()}, all rendered into the prompt; "
                   f"{context}: {fix}")
    else:
        message = f"the messages hold {size.describe()}; {context}: shorten the messages"
    raise invalid_request(message, param=size.largest_param, code="context_length_exceeded")


def _no_room_for_output(req: AnyRequest, num_prompt_tokens: int, max_model_len: int) -> OpenAIError:
    return invalid_request(
        f"the prompt has {num_prompt_tokens} tokens; this model's context is {max_model_len} tokens "
        "and leaves no room for output: shorten the prompt",
        param=prompt_param(req), code="context_length_exceeded")


def prepare_prompt(tokenizer: Tokenizer, req: AnyRequest, hash_seed: int, block_size: int) -> Prompt:
    ids = _token_ids(tokenizer, req)
    return Prompt(ids, tuple(hash_prompt_blocks(hash_seed, ids, block_size)))


def _token_ids(tokenizer: Tokenizer, req: AnyRequest) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        try:
            ids = tokenizer.apply_chat_template(template_messages(req))  # tool turns and tools too
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
        raise _no_room_for_output(req, num_prompt_tokens, max_model_len)
    if requested is None:  # the default cap, raised to what min_tokens asks for
        floor = getattr(req, "min_tokens", None) or 0
        return room if default_max_tokens is None else min(max(default_max_tokens, floor), room)
    if requested > room:   # requested < 1 was already refused by limits.check_limits
        raise invalid_request(
            f"the prompt has {num_prompt_tokens} tokens and {max_tokens_param} is {requested}, "
            f"together {num_prompt_tokens + requested}; this model's context is {max_model_len} tokens: "
            f"shorten the prompt or set {max_tokens_param} to at most {room}",
            param=max_tokens_param, code="context_length_exceeded")
    return requested
