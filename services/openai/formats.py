"""How one generation is shaped for each endpoint: the whole response, or
its stream chunks.  The two formats share ``Tally``."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.backend import StreamChunk
from services.openai.responses import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
    CompletionChoice, CompletionResponse, Usage,
)
from services.openai.sse import sse_event


@dataclass
class Tally:
    """What the backend streamed so far."""
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    text_parts: list[str] = field(default_factory=list)

    def add(self, chunk: StreamChunk) -> None:
        self.completion_tokens += len(chunk.token_ids)
        self.cached_tokens = max(self.cached_tokens, chunk.num_cached_tokens)
        self.text_parts.append(chunk.text)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


@dataclass(frozen=True)
class ResponseFormat:
    """Identity shared by every chunk of one response."""
    id: str
    created: int
    model: str

    def opening(self) -> bytes | None:
        """An event before the first token, if the format has one."""
        return None

    def delta(self, text: str, finish_reason: str | None) -> bytes:
        raise NotImplementedError

    def usage(self, usage: Usage) -> bytes:
        raise NotImplementedError

    def response(self, tally: Tally) -> CompletionResponse | ChatCompletionResponse:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    def delta(self, text: str, finish_reason: str | None) -> bytes:
        return sse_event(CompletionResponse(id=self.id, created=self.created, model=self.model,
                                            choices=[CompletionChoice(text=text, finish_reason=finish_reason)]))

    def usage(self, usage: Usage) -> bytes:
        return sse_event(CompletionResponse(id=self.id, created=self.created, model=self.model,
                                            choices=[], usage=usage))

    def response(self, tally: Tally) -> CompletionResponse:
        choice = CompletionChoice(text=tally.text, finish_reason=tally.finish_reason)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                  usage=tally.usage())


class ChatFormat(ResponseFormat):
    def _chunk(self, delta: ChatDelta, finish_reason: str | None) -> bytes:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return sse_event(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice]))

    def opening(self) -> bytes:
        return self._chunk(ChatDelta(role="assistant", content=""), None)

    def delta(self, text: str, finish_reason: str | None) -> bytes:
        return self._chunk(ChatDelta(content=text or None), finish_reason)

    def usage(self, usage: Usage) -> bytes:
        return sse_event(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                             choices=[], usage=usage))

    def response(self, tally: Tally) -> ChatCompletionResponse:
        assert tally.finish_reason is not None
        choice = ChatChoice(message=AssistantMessage(content=tally.text), finish_reason=tally.finish_reason)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                      usage=tally.usage())
