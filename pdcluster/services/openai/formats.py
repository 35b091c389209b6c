"""How one generation is shaped for each endpoint: the whole response, or
its stream chunks.  The two formats share ``Tally``, which keeps each
choice's part of the stream (``TokenDelta.index``; n > 1 merges n streams,
choices.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.services.messages import TokenDelta
from pdcluster.services.token_logprob import TokenLogprob
from pdcluster.services.openai.logprobs_format import ChatLogprobs, CompletionLogprobs, LogprobRenderer
from pdcluster.services.openai.responses import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
    CompletionChoice, CompletionResponse, Usage,
)
from pdcluster.services.openai.sse import sse_event


@dataclass
class ChoiceTally:
    """What the backend streamed so far for one choice."""
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_events: int = 0      # stream events sent for it (echo prefixes the first)
    text_offset: int = 0     # characters of it sent so far (completions' text_offset)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass
class Tally:
    """What the backend streamed so far, per choice.  Usage counts the
    prompt once and every choice's tokens; ``cached_tokens`` is the most any
    choice found cached (with n > 1, choices 2..n reuse choice 1's prompt)."""
    prompt_tokens: int
    n: int = 1
    prompt_logprobs: list[TokenLogprob] | None = None   # entry j = prompt token j+1 (echo)
    choices: dict[int, ChoiceTally] = field(default_factory=dict)

    def choice(self, index: int) -> ChoiceTally:
        return self.choices.setdefault(index, ChoiceTally())

    def add(self, chunk: TokenDelta) -> None:
        c = self.choice(chunk.index)
        c.completion_tokens += len(chunk.token_ids)
        c.cached_tokens = max(c.cached_tokens, chunk.num_cached_tokens)
        c.text_parts.append(chunk.text)
        if chunk.logprobs:
            c.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            c.finish_reason = chunk.finish_reason

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason."""
        return len(self.choices) == self.n and all(c.finish_reason is not None for c in self.choices.values())

    @property
    def finish_reason(self) -> str | None:
        """The first choice's (the only one when n = 1)."""
        return self.choice(0).finish_reason

    @property
    def text(self) -> str:
        return self.choice(0).text

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices.values())

    @property
    def cached_tokens(self) -> int:
        return max((c.cached_tokens for c in self.choices.values()), default=0)

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


@dataclass(frozen=True)
class Echo:
    """The prompt a completion echoes before its text (``echo: true``)."""
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ResponseFormat:
    """Identity shared by every chunk of one response, and what each choice
    carries besides text: logprobs (``logprobs`` set when the client asked)
    and, for completions, the echoed prompt."""
    id: str
    created: int
    model: str
    n: int = 1
    logprobs: LogprobRenderer | None = None
    echo: Echo | None = None
    # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far
    continuous_usage: bool = False
    _usage_now: list[Usage] = field(default_factory=list, compare=False, repr=False)   # set by event()

    def opening(self) -> bytes | None:
        """An event before the first token, if the format has one."""
        return None

    def event(self, chunk: TokenDelta, tally: Tally) -> bytes | None:
        """The stream event for ``chunk`` (already added to ``tally``), or None
        when it carries nothing to show yet."""
        c = tally.choice(chunk.index)
        first = c.num_events == 0
        if not (chunk.text or chunk.finish_reason is not None or chunk.logprobs or (first and self.echo)):
            return None
        c.num_events += 1
        if self.continuous_usage:
            self._usage_now[:] = [tally.usage()]
        return self._event(chunk, tally, c, first)

    def _chunk_usage(self) -> Usage | None:
        """What a stream chunk carries as ``usage``: None unless continuous."""
        return self._usage_now[0] if self._usage_now else None

    def _event(self, chunk: TokenDelta, tally: Tally, c: ChoiceTally, first: bool) -> bytes:
        return self.delta(chunk.text, chunk.finish_reason, chunk.index)

    def delta(self, text: str, finish_reason: str | None, index: int = 0, logprobs=None) -> bytes:
        raise NotImplementedError

    def usage(self, usage: Usage) -> bytes:
        raise NotImplementedError

    def response(self, tally: Tally) -> CompletionResponse | ChatCompletionResponse:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    def _event(self, chunk: TokenDelta, tally: Tally, c: ChoiceTally, first: bool) -> bytes:
        text, entries = chunk.text, list(chunk.logprobs or ())
        if first and self.echo is not None:
            text = self.echo.text + text
            entries = self._prompt_entries(tally) + entries
        logprobs = None
        if self.logprobs is not None:
            logprobs, c.text_offset = self.logprobs.completion(entries, c.text_offset)
        return self.delta(text, chunk.finish_reason, chunk.index, logprobs)

    def _prompt_entries(self, tally: Tally) -> list[TokenLogprob | int]:
        """The echoed prompt's entries: its first token bare (no logprob), then the scored ones."""
        if self.logprobs is None or self.echo is None:
            return []
        return [self.echo.token_ids[0], *(tally.prompt_logprobs or ())]

    def delta(self, text: str, finish_reason: str | None, index: int = 0,
              logprobs: CompletionLogprobs | None = None) -> bytes:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
        return sse_event(CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                            usage=self._chunk_usage()))

    def usage(self, usage: Usage) -> bytes:
        return sse_event(CompletionResponse(id=self.id, created=self.created, model=self.model,
                                            choices=[], usage=usage))

    def _choice(self, index: int, c: ChoiceTally, tally: Tally) -> CompletionChoice:
        text = c.text if self.echo is None else self.echo.text + c.text
        logprobs = None
        if self.logprobs is not None:
            logprobs, _ = self.logprobs.completion(self._prompt_entries(tally) + c.logprobs, 0)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason)

    def response(self, tally: Tally) -> CompletionResponse:
        choices = [self._choice(i, tally.choice(i), tally) for i in range(self.n)]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=tally.usage())


class ChatFormat(ResponseFormat):
    def _chunk(self, delta: ChatDelta, finish_reason: str | None, index: int = 0,
               logprobs: ChatLogprobs | None = None) -> bytes:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return sse_event(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice],
                                             usage=self._chunk_usage()))

    def opening(self) -> bytes:
        return b"".join(self._chunk(ChatDelta(role="assistant", content=""), None, i) for i in range(self.n))

    def _event(self, chunk: TokenDelta, tally: Tally, c: ChoiceTally, first: bool) -> bytes:
        logprobs = self.logprobs.chat(chunk.logprobs) if self.logprobs is not None and chunk.logprobs else None
        return self.delta(chunk.text, chunk.finish_reason, chunk.index, logprobs)

    def delta(self, text: str, finish_reason: str | None, index: int = 0,
              logprobs: ChatLogprobs | None = None) -> bytes:
        return self._chunk(ChatDelta(content=text or None), finish_reason, index, logprobs)

    def usage(self, usage: Usage) -> bytes:
        return sse_event(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                             choices=[], usage=usage))

    def response(self, tally: Tally) -> ChatCompletionResponse:
        assert tally.finished
        choices = []
        for i in range(self.n):
            c = tally.choice(i)
            logprobs = self.logprobs.chat(c.logprobs) if self.logprobs is not None else None
            choices.append(ChatChoice(index=i, message=AssistantMessage(content=c.text), logprobs=logprobs,
                                      finish_reason=c.finish_reason))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=tally.usage())
