"""The seam between the OpenAI-compatible HTTP layer and whatever serves
tokens behind it (the disaggregated cluster, a colocated pool, or a fake in
unit tests).  The HTTP layer tokenizes and validates; the backend only
streams tokens and raises the typed errors below."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.engine.logprobs import TokenLogprob
from services.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_hashes: tuple[int, ...] = ()     # chained hashes of the prompt's full blocks (routing)
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C carrier
    faults: tuple[str, ...] = ()           # test-only fault injection (services/pools/faults.py)
    # Prefill on this replica (by worker name): it holds the prompt's blocks (choices 2..n of one
    # request, services/openai/choices.py).  None: the router picks.
    prefill_worker: str | None = None


@dataclass(frozen=True)
class StreamChunk:
    """Tokens produced since the previous chunk, and their text."""
    token_ids: list[int]
    text: str
    finish_reason: str | None = None      # "stop" | "length" on the last chunk
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    index: int = 0                        # the choice it belongs to (n > 1)
    logprobs: list[TokenLogprob] | None = None         # one per token, with params.logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # on a choice's first chunk, with params.prompt_logprobs
    worker_name: str = ""                 # on a choice's first chunk: the replica that prefilled it


class BackendError(Exception):
    """Base of errors a backend raises; ``status`` is the HTTP status to answer."""
    status = 500
    code = "internal_error"
    type = "server_error"


class BackendOverloaded(BackendError):
    status, code, type = 429, "overloaded", "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendUnavailable(BackendError):
    status, code, type = 503, "no_replica", "server_error"


class BackendInvalidRequest(BackendError):
    status, code, type = 400, "invalid_request", "invalid_request_error"


class BackendFailure(BackendError):
    """A replica failed mid-request (a stream ends with an error event)."""
    status, code, type = 502, "replica_failed", "server_error"


class BackendKVTransferFailed(BackendFailure):
    """The decode replica's pull of the prefill hand-off broke (the prefill
    replica died, or the connection did): the request can be recomputed."""


class BackendTimeout(BackendError):
    """A deadline passed (end-to-end, or the inter-token gap); the request was aborted everywhere."""
    status, code, type = 504, "deadline_exceeded", "server_error"


class BackendLeaseExpired(BackendError):
    """The prefill hand-off's KV lease ran out before the decode side could
    pull it: refusing is the alternative to reading recycled blocks."""
    status, code, type = 503, "kv_lease_expired", "server_error"


class Backend(abc.ABC):
    model_name: str
    max_model_len: int

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """Streams chunks; cancelling the iteration aborts the request and
        frees its KV everywhere."""

    async def health(self) -> dict:
        return {"status": "ok"}
