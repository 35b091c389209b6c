"""The ``logprobs`` object of a choice, in OpenAI's two shapes, from the
engine's ``TokenLogprob`` entries (pdcluster/services/engine/logprobs.py).

    chat         choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
                 bytes}, ...]}, ...]}
    completions  choices[i].logprobs = {tokens: [...], token_logprobs: [...], top_logprobs: [{token: logprob},
                 ...], text_offset: [...]}

A token's text is what decoding it alone gives (special tokens spelled out);
its ``bytes`` are the token's own bytes, so a token holding half of a
UTF-8 character shows U+FFFD as text but its true bytes.  ``text_offset``
counts characters of the returned text (the echoed prompt first).  With
``echo``, the first prompt token has no logprob (null), as in OpenAI and
vLLM.  Both shapes list the top alternatives likeliest first; the
completions dict also holds the chosen token, as OpenAI's legacy API does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from pydantic import BaseModel

from pdcluster.services.token_logprob import TokenLogprob
from pdcluster.services.tokenizer import Tokenizer


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_alphabet()
_SPELLINGS: WeakKeyDictionary[Tokenizer, dict[int, tuple[str, list[int]]]] = WeakKeyDictionary()


def spelling(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text and its bytes (cached per tokenizer: the same few
    thousand tokens come back all the time)."""
    cache = _SPELLINGS.get(tokenizer)
    if cache is None:
        cache = _SPELLINGS[tokenizer] = {}
    hit = cache.get(token_id)
    if hit is None:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        piece = tokenizer.convert_ids_to_tokens([token_id])[0] or ""
        is_bytes = piece and token_id not in _special_ids(tokenizer) and all(c in _BYTE_OF for c in piece)
        raw = [_BYTE_OF[c] for c in piece] if is_bytes else list(text.encode())
        hit = cache[token_id] = (text, raw)
    return hit


def _special_ids(tokenizer: Tokenizer) -> set[int]:
    return set(tokenizer.all_special_ids)


@dataclass(frozen=True)
class LogprobRenderer:
    """Turns entries into one endpoint's shape; ``top_k`` alternatives each."""
    tokenizer: Tokenizer
    top_k: int

    def chat(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[self._chat_entry(e) for e in entries])

    def _chat_entry(self, e: TokenLogprob) -> ChatTokenLogprob:
        text, raw = spelling(self.tokenizer, e.token_id)
        top = []
        for token_id, logprob in e.top[:self.top_k]:
            t, b = spelling(self.tokenizer, token_id)
            top.append(ChatTopLogprob(token=t, logprob=logprob, bytes=b))
        return ChatTokenLogprob(token=text, logprob=e.logprob, bytes=raw, top_logprobs=top)

    def completion(self, entries: Sequence[TokenLogprob | int], text_offset: int) -> tuple[CompletionLogprobs, int]:
        """``entries``: a TokenLogprob per token, or a bare token id for one
        without a logprob (the first echoed prompt token).  Returns the shape
        and the text offset after the last token."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for e in entries:
            token_id = e if isinstance(e, int) else e.token_id
            text, _ = spelling(self.tokenizer, token_id)
            out.tokens.append(text)
            out.text_offset.append(text_offset)
            text_offset += len(text)
            if isinstance(e, int):
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(e.logprob)
            top = {spelling(self.tokenizer, t)[0]: lp for t, lp in e.top[:self.top_k]}
            top.setdefault(text, e.logprob)   # the chosen token too, as OpenAI's legacy API
            out.top_logprobs.append(top)
        return out, text_offset
