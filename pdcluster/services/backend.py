"""The seam between the OpenAI-compatible HTTP layer and whatever serves
tokens behind it (the disaggregated cluster, a colocated pool, or a fake in
unit tests).  The HTTP layer tokenizes and validates; the backend only
streams tokens and raises the typed errors below."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

from pdcluster.services.engine_errors import EngineDeadError, InvalidRequestError, RequestFailedError
from pdcluster.services.messages import GenerateRequest, TokenDelta


class BackendError(Exception):
    """Base of errors a backend raises; ``status`` is the HTTP status to answer.

    ``client_safe``: the message was written for the client -- the cause and
    the fix, no replica names, peer ids, endpoints or exception text.  Any
    other message goes to the log and the trace, and the client is told its
    class's sentence instead (pdcluster/services/openai/errors.py).  ``for_client``
    marks one message; a class whose every message is safe sets it."""
    status = 500
    code = "internal_error"
    type = "server_error"
    client_safe = False


class BackendOverloaded(BackendError):
    status, code, type = 429, "overloaded", "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BackendUnavailable(BackendError):
    status, code, type = 503, "no_replica", "server_error"


class BackendInvalidRequest(BackendError):
    status, code, type = 400, "invalid_request", "invalid_request_error"
    # The engine's validators (InvalidRequestError) write these for the client: the field, its bound, the fix.
    client_safe = True


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


E = TypeVar("E", bound=BackendError)


def for_client(exc: E) -> E:
    """``exc``, its message marked as written for the client (see BackendError)."""
    exc.client_safe = True
    return exc


def as_backend_error(exc: BaseException) -> BaseException:
    """The engine's typed errors as the BackendError that carries their HTTP
    meaning (across the Serve hop, and to pdcluster/services/openai/errors.py); anything
    else unchanged.  The one place an engine error gets its status."""
    if isinstance(exc, InvalidRequestError):
        return BackendInvalidRequest(str(exc))
    if isinstance(exc, RequestFailedError):
        return BackendFailure(str(exc))
    if isinstance(exc, EngineDeadError):
        return BackendUnavailable(f"{exc}; the replica is being replaced: retry")
    return exc


@contextlib.contextmanager
def engine_errors_as_backend_errors() -> Iterator[None]:
    try:
        yield
    except (InvalidRequestError, RequestFailedError, EngineDeadError) as exc:
        raise as_backend_error(exc) from exc


class Backend(abc.ABC):
    model_name: str
    max_model_len: int

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Streams deltas; cancelling the iteration aborts the request and
        frees its KV everywhere."""

    async def health(self) -> dict:
        return {"status": "ok"}
