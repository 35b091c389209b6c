"""OpenAI-style error bodies, and the handlers that turn every failure into
one: ``{"error": {"message", "type", "param", "code"}}``.

Client mistakes answer 4xx (never FastAPI's 422, never a 5xx); backend
trouble answers the status its typed error carries (429 with Retry-After,
503, 502)."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.backend import BackendError, BackendOverloaded, as_backend_error
from services.engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError

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


def from_backend_error(exc: BackendError) -> OpenAIError:
    headers = {}
    if isinstance(exc, BackendOverloaded):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return OpenAIError(exc.status, str(exc) or type(exc).__name__, type=exc.type, code=exc.code, headers=headers)


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
        return error_response(from_backend_error(exc), request)

    async def on_engine_error(request: Request, exc: Exception) -> JSONResponse:
        # An engine in this process (tests, colocated): the same mapping as across the Serve hop.
        return error_response(from_backend_error(as_backend_error(exc)), request)

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
