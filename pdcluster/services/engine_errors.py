"""Errors a caller can hit; each message says what to do next."""


class EngineError(Exception):
    """Base of the engine's typed errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request can never be served as given (HTTP 400)."""


class InvalidRequestReason(str):
    """Why a request failed mid-generation when the request itself is at
    fault (its grammar allows no next token): a failure message that maps to
    InvalidRequestError (HTTP 400) instead of RequestFailedError (500/502)."""


class RequestTooLongError(InvalidRequestError):
    """Prompt plus max_tokens exceed the context or the KV pool."""


class UnknownRequestError(EngineError, KeyError):
    """No such request (finished, aborted, or never added)."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop died; the replica should be restarted."""


class RequestFailedError(EngineError, RuntimeError):
    """This request failed inside the engine (a numerical error in its logits,
    or a step that raised while it was scheduled); the engine and every other
    request carry on, so retrying it is safe (HTTP 500)."""
