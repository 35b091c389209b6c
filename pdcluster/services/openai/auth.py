"""API keys on the OpenAI API, as pure ASGI middleware (streams and
disconnects pass untouched once a request is let in).

    no key configured                (OpenAISettings.api_key_digests empty)  -> let in
    path in OPEN_PATHS               (/health, /live, /ready, /openapi.json) -> let in
    exactly one `Authorization: Bearer <token>` header, and
      sha256(token) equals one of api_key_digests                            -> let in
    anything else                                                            -> 401

A request let in carries its tenant in ``request.state.tenant``: its key's
tenant (OpenAISettings.tenant_of_digest), ``default`` for a key of no tenant
or no key, or -- only with ``trust_tenant_header`` -- the name in
``x-pdcluster-tenant``.

A 401 is an OpenAI-style body (``code: invalid_api_key``) with
``WWW-Authenticate: Bearer``; it never echoes what the client sent.  The
gateway holds only the keys' digests (pdcluster.services.config.api_key_digest), and
every digest is compared, in constant time, whichever matches: the time an
answer takes says nothing about which key, or how much of one, was right.
Every other path, /v1 and unknown ones alike, needs the key: a new route is
closed until it is listed here."""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pdcluster.services.config import DEFAULT_TENANT, api_key_digest
from pdcluster.services.openai.errors import OpenAIError

log = logging.getLogger(__name__)

TENANT_HEADER = "x-pdcluster-tenant"
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
OPEN_PATHS = frozenset({"/health", "/live", "/ready", "/openapi.json"})  # probes carry no key
_CHALLENGE = 'Bearer realm="pdcluster"'
_HOW = "send `Authorization: Bearer <key>` (the openai client's api_key does)"


def key_matches(token: bytes, digests: tuple[str, ...]) -> bool:
    """Whether ``token`` is one of the keys behind ``digests``; compares with
    every digest, so neither the answer's time nor its path depends on which
    one matched."""
    return matching_digest(token, digests) is not None


def matching_digest(token: bytes, digests: tuple[str, ...]) -> str | None:
    """The digest of ``token`` if it is one of ``digests`` (compared with every one, as key_matches), else None."""
    presented = api_key_digest(token)
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(presented, digest)
    return presented if matched else None


def refusal(headers: Headers, digests: tuple[str, ...]) -> OpenAIError | None:
    """None when the request carries one of the keys; else the 401 to answer."""
    return _checked_key(headers, digests)[0]


def _checked_key(headers: Headers, digests: tuple[str, ...]) -> tuple[OpenAIError | None, str | None]:
    """(the 401 to answer, None) or (None, the matching key's digest)."""
    values = headers.getlist("authorization")
    if not values:
        return _unauthorized(f"no API key provided: {_HOW}"), None
    parts = values[0].split()
    if len(values) > 1 or len(parts) != 2 or parts[0].lower() != "bearer":
        return _unauthorized(f"the Authorization header is not one `Bearer <key>`: {_HOW}", "invalid_request"), None
    digest = matching_digest(parts[1].encode("latin-1"), digests)
    if digest is not None:
        return None, digest
    return _unauthorized("incorrect API key provided: use one of the keys this server was started with",
                         "invalid_token"), None


def tenant_of(headers: Headers, key_digest: str | None, tenant_of_digest: Mapping[str, str],
              trust_header: bool) -> str:
    """The request's tenant: its key's (a key of no tenant: DEFAULT_TENANT), or
    with ``trust_header`` the x-pdcluster-tenant header's when it is a valid name."""
    if trust_header:
        named = headers.get(TENANT_HEADER, "")
        if TENANT_NAME.fullmatch(named):
            return named
    return tenant_of_digest.get(key_digest or "", DEFAULT_TENANT)


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
    """The 401/503 to answer, or None: then the request's tenant is in scope["state"]["tenant"]."""
    settings = getattr(getattr(scope.get("app"), "state", None), "openai_settings", None)
    if settings is None:
        return OpenAIError(503, "the gateway is not ready (no settings yet); retry shortly", type="server_error",
                           code="not_ready", headers={"Retry-After": "1"})
    headers, err, digest = Headers(scope=scope), None, None
    if settings.api_key_digests:
        err, digest = _checked_key(headers, settings.api_key_digests)
    if err is None:
        scope.setdefault("state", {})["tenant"] = tenant_of(headers, digest, settings.tenant_of_digest,
                                                            settings.trust_tenant_header)
    return err
