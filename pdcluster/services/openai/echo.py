"""``echo`` on /v1/completions: the prompt comes back before the text, and
with ``logprobs`` every prompt token's log-probability too (the first one's
is null: nothing comes before it).  ``max_tokens: 0`` asks for the prompt
alone -- how lm-eval style harnesses score a continuation (loglikelihood):
the engine runs one token, which ``prompt_only`` drops."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from pdcluster.services.messages import TokenDelta
from pdcluster.services.tokenizer import Tokenizer
from pdcluster.services.openai.formats import Echo
from pdcluster.services.openai.protocol import AnyRequest, CompletionRequest


def scoring_request(req: AnyRequest) -> tuple[AnyRequest, bool]:
    """``req`` to run, and whether only its prompt is wanted (echo with
    max_tokens 0: run with 1, drop it).  Anything else is unchanged (and a
    max_tokens of 0 without echo is refused by the range check as before)."""
    if isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0:
        return req.model_copy(update={"max_tokens": 1}), True
    return req, False


def echo_of(tokenizer: Tokenizer, req: AnyRequest, token_ids: list[int]) -> Echo | None:
    """What an echoing completion repeats: the client's own prompt string, or
    the decoded token ids it sent."""
    if not isinstance(req, CompletionRequest) or not req.echo:
        return None
    text = req.prompt if isinstance(req.prompt, str) else tokenizer.decode(token_ids, skip_special_tokens=False)
    return Echo(text, tuple(token_ids))


async def prompt_only(chunks: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
    """Each choice's stream with its generated token dropped: one chunk with
    the prompt logprobs (if any) and finish_reason "length"."""
    try:
        async for chunk in chunks:
            if chunk.finish_reason is None and chunk.prompt_logprobs is None:
                continue
            yield dataclasses.replace(chunk, token_ids=[], text="", logprobs=None,
                                      finish_reason="length" if chunk.finish_reason is not None else None)
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
