"""API keys on the OpenAI API, as pure ASGI middleware (streams and
disconnects pass untouched once a request is let in).

    no key configured                (OpenAISettings.api_key_digests empty)  -> let in
    path in OPEN_PATHS               (/health, /live, /ready, /openapi.json) -> let in
    exactly one `Authorization: Bearer <token>` header, and
      sha256(token) equals one of api_key_digests                            -> let in
    anything else                                                            -> 401

A 401 is an OpenAI-style body (``code: invalid_api_key``) with
``WWW-Authenticate: Bearer``; it never echoes what the client sent.  The
gateway holds only the keys' digests (services.config.api_key_digest), and
every digest is compared, in constant time, whichever matches: the time an
answer takes says nothing about which key, or how much of one, was right.
Every other path, /v1 and unknown ones alike, needs the key: a new route is
closed until it is listed here."""

from __future__ import annotations

import hmac
import logging

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from services.config import api_key_digest
from services.openai.errors import OpenAIError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/live", "/ready", "/openapi.json"})  # probes carry no key
_CHALLENGE = 'Bearer realm="pdcluster"'
_HOW = "send `Authorization: Bearer <key>` (the openai client's api_key does)"


def key_matches(token: bytes, digests: tuple[str, ...]) -> bool:
    """Whether ``token`` is one of the keys behind ``digests``; compares with
    every digest, so neither the answer's time nor its path depends on which
    one matched."""
    presented = api_key_digest(token)
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(presented, digest)
    return matched


def refusal(headers: Headers, digests: tuple[str, ...]) -> OpenAIError | None:
    """None when the request carries one of the keys; else the 401 to answer."""
    values = headers.getlist("authorization")
    if not values:
        return _unauthorized(f"no API key provided: {_HOW}")
    parts = values[0].split()
    if len(values) > 1 or len(parts) != 2 or parts[0].lower() != "bearer":
        return _unauthorized(f"the Authorization header is not one `Bearer <key>`: {_HOW}", "invalid_request")
    if key_matches(parts[1].encode("latin-1"), digests):
        return None
    return _unauthorized("incorrect API key provided: use one of the keys this server was started with",
                         "invalid_token")


def _unauthorized(message: str, error: str | None = None) -> OpenAIError:
    challenge = _CHALLENGE + (f', error="{error}"' if error else "")
    return OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": challenge})


def _route_path(scope: Scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class ApiKeyMiddleware:
    """Reads the keys' digests from ``app.state.openai_settings`` on every
    request, so the host may configure the app after it is built.  Before
    that a protected path answers 503, never lets a request through."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = None
        if scope["type"] in ("http", "websocket") and _route_path(scope) not in OPEN_PATHS:
            err = _gate(scope)
        if err is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            log.debug("refused %s %s: %s", scope.get("method"), _route_path(scope), err.message)
            await JSONResponse(err.payload(), status_code=err.status, headers=err.headers)(scope, receive, send)


def _gate(scope: Scope) -> OpenAIError | None:
    settings = getattr(getattr(scope.get("app"), "state", None), "openai_settings", None)
    if settings is None:
        return OpenAIError(503, "the gateway is not ready (no settings yet); retry shortly", type="server_error",
                           code="not_ready", headers={"Retry-After": "1"})
    if not settings.api_key_digests:
        return None
    return refusal(Headers(scope=scope), settings.api_key_digests)
