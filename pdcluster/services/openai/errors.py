"""OpenAI-style error bodies, and the handlers that turn every failure into
one: ``{"error": {"message", "type", "param", "code"}}``.

Client mistakes answer 4xx (never FastAPI's 422, never a 5xx); backend
trouble answers the status its typed error carries (429 with Retry-After,
503, 502).

No internals reach a client: a backend error's own text (replica names,
peer ids, endpoints, exception text) is told only when its raiser wrote it
for the client (``BackendError.client_safe``); otherwise the client gets
the cause and the fix for its class (``client_message``), and the text goes
to the log and the request's trace span, keyed by the request id."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdcluster.observability import tracing
from pdcluster.services.backend import (
    BackendError, BackendFailure, BackendInvalidRequest, BackendKVTransferFailed, BackendLeaseExpired,
    BackendOverloaded, BackendTimeout, BackendUnavailable, as_backend_error,
)
from pdcluster.services.engine_errors import EngineDeadError, InvalidRequestError, RequestFailedError

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"


class OpenAIError(Exception):
    """An error answered as an OpenAI-style body with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# What a client is told of a backend error whose text was not written for it:
# the cause and the fix.  First match wins (subclasses before their base).
_CLIENT_MESSAGES: tuple[tuple[type[BackendError], str], ...] = (
    (BackendLeaseExpired, "the prompt's KV cache expired before a decode replica could read it (the cluster is "
                          "busy); retry the request"),
    (BackendKVTransferFailed, "moving the prompt's KV cache between replicas failed; retry the request"),
    (BackendFailure, "a replica failed while serving this request; retry the request, and report the "
                     "x-request-id if it persists"),
    (BackendTimeout, "the request ran past its deadline and was aborted; retry it, or ask for fewer tokens"),
    (BackendOverloaded, "the cluster is at capacity; retry after the seconds in the Retry-After header"),
    (BackendUnavailable, "no replica can serve this request right now (one may be starting or being replaced); "
                         "retry in a few seconds"),
    (BackendInvalidRequest, "a replica refused this request's parameters; check them against GET /openapi.json"),
    (BackendError, "internal server error; retry, and report the x-request-id if it persists"),
)


def client_message(exc: BackendError) -> str:
    """The message a client gets for ``exc``: its own when written for the
    client, else its class's cause and fix (never replica names, peer ids,
    endpoints or exception text)."""
    if exc.client_safe and str(exc):
        return str(exc)
    return next(text for kind, text in _CLIENT_MESSAGES if isinstance(exc, kind))


def from_backend_error(exc: BackendError) -> OpenAIError:
    headers = {}
    if isinstance(exc, BackendOverloaded):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return OpenAIError(exc.status, client_message(exc), type=exc.type, code=exc.code, headers=headers)


def record_backend_error(exc: BackendError, request_id: str | None, where: str = "before the response") -> None:
    """The error's own text, which the client may not have been told, to the
    log (one line; a warning for a 5xx) and the current trace span."""
    cause = exc.__cause__
    detail = f"{type(exc).__name__}: {exc}" + (f" (cause: {type(cause).__name__}: {cause})" if cause else "")
    level = logging.WARNING if exc.status >= 500 else logging.INFO
    log.log(level, "request_id=%s failed %s: %d %s: %s", request_id, where, exc.status, exc.code, detail)
    tracing.set_attrs({"error.type": type(exc).__name__, "error.code": exc.code, "error.detail": detail[:1000]})


# -- pydantic errors -> one 400 naming the field -------------------------------------------

_FIELD_HINTS = {
    "prompt": "must be a string or a list of token ids (batches of prompts are not supported: "
              "send one request per prompt)",
    "stop": "must be a string or a list of strings",
    "messages": "must be a list of {role, content} objects",
}
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _param(loc: tuple) -> str:
    """``('body', 'messages', 0, 'content', 'str')`` -> ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "body" and not out:
            continue
        elif "[" in part or "-" in part or part in _UNION_TAGS:
            continue   # pydantic's name for a union member, not a field
        else:
            out += f".{part}" if out else part
    return out


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """The first problem pydantic found, said the way OpenAI says it."""
    if not errors:
        return invalid_request("the request body is not a valid request object")
    first = errors[0]
    param = _param(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"unrecognized request argument '{param}': this server does not support it; remove it"
        return invalid_request(message, param=param, code="unsupported_parameter")
    if kind == "missing":
        return invalid_request(f"'{param}' is required", param=param, code="missing_required_parameter")
    if param in _FIELD_HINTS:   # a union field: one plain sentence beats one error per member
        got = f", got {_short(first['input'])}" if "input" in first else ""
        return invalid_request(f"'{param}' {_FIELD_HINTS[param]}{got}", param=param, code="invalid_type")
    # Within a union pydantic reports one error per member; the deepest is the most specific.
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _param(tuple(err.get("loc", ())))
    detail = err.get("msg", "invalid value").rstrip(".").lower()
    got = f", got {_short(err['input'])}" if "input" in err else ""
    return invalid_request(f"'{param}' {detail}{got}", param=param or None, code="invalid_type")


# -- handlers -------------------------------------------------------------------------------

def error_response(err: OpenAIError, request: Request | None = None, with_request_id: bool = False) -> JSONResponse:
    headers = dict(err.headers)
    request_id = getattr(request.state, "request_id", None) if request is not None else None
    if with_request_id and request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(err.payload(), status_code=err.status, headers=headers)


def install_error_handlers(app: FastAPI, request_id_header: bool = True) -> None:
    """Every error the app can raise answers an OpenAI-style body."""

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return error_response(exc, request)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(list(exc.errors())), request)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}: see GET /v1/models, " \
                      "POST /v1/completions, POST /v1/chat/completions, GET /health"
            err = OpenAIError(404, message, code="not_found")
        elif exc.status_code == 405:
            err = OpenAIError(405, f"{request.method} is not allowed on {request.url.path}",
                              code="method_not_allowed", headers=dict(exc.headers or {}))
        else:
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            err = OpenAIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {}))
        return error_response(err, request)

    async def on_backend_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BackendError)
        record_backend_error(exc, getattr(request.state, "request_id", None))
        return error_response(from_backend_error(exc), request)

    async def on_engine_error(request: Request, exc: Exception) -> JSONResponse:
        # An engine in this process (tests, colocated): the same mapping as across the Serve hop.
        err = as_backend_error(exc)
        assert isinstance(err, BackendError)
        record_backend_error(err, getattr(request.state, "request_id", None))
        return error_response(from_backend_error(err), request)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Runs outside every middleware, so it adds x-request-id itself.
        log.exception("unhandled error on %s %s request_id=%s", request.method, request.url.path,
                      getattr(request.state, "request_id", None))
        err = OpenAIError(500, "internal server error; retry, and report the x-request-id if it persists",
                          type="server_error", code="internal_error")
        return error_response(err, request, with_request_id=request_id_header)

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(BackendError, on_backend_error)
    for engine_error in (InvalidRequestError, RequestFailedError, EngineDeadError):
        app.add_exception_handler(engine_error, on_engine_error)
    app.add_exception_handler(Exception, on_unexpected)
