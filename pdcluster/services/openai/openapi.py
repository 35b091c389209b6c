"""The published OpenAPI document (GET /openapi.json), for clients and for
schema-driven fuzzing.

The POST handlers read and validate their bodies themselves -- the size
limit comes before a byte is parsed (intake.read_request) -- so FastAPI
cannot see their request models.  Each POST route names its model through
``openapi_extra=request_body(Model)``, and ``install_openapi`` adds the
models' JSON schemas to the document's components.  The bounds inside those
schemas are the ones limits.check_limits enforces."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pdcluster.services.openai.responses import ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"

_ERROR_MEANINGS = {
    400: "invalid request: the message names the field and the fix",
    404: "no such model (see GET /v1/models)",
    413: "request body over the size limit",
    429: "overloaded: retry after Retry-After seconds",
    500: "a bug: report the x-request-id",
    502: "a replica failed: retry",
    503: "no replica available, or the gateway is not ready yet: retry",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads one of ``models`` as its JSON
    body (list them in ``install_openapi``'s ``request_models`` too).  Several
    models: the body is any one of them (the handler tells which apart)."""
    schema = _ref(models[0]) if len(models) == 1 else {"anyOf": [_ref(m) for m in models]}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERROR_MEANINGS[s]} for s in statuses}


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream (the schema of a ``text/event-stream``
    entry describes each event, before OpenAPI 3.2's ``itemSchema``): a
    ``chunk`` as JSON, an error body (a failure after the first chunk), or the
    final ``[DONE]``."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}


def generation_responses(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``model`` as JSON, or (``stream: true``) server-sent events of ``chunk``, or an error."""
    ok = {"model": model, "description": f"a {model.__name__}, or with stream: true server-sent events of "
                                         f"{chunk.__name__} ending with data: [DONE]",
          "content": {"text/event-stream": {"schema": _sse_event(chunk)}}}
    return {200: ok, **error_responses(400, 404, 413, 429, 500, 502, 503)}


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]],
                    stream_models: list[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` include ``request_models`` and the ``stream_models``
    of server-sent events (and the models they use) as components."""
    _, top = models_json_schema([(m, "validation") for m in request_models]
                                + [(m, "serialization") for m in stream_models], ref_template=REF_TEMPLATE)
    extra_schemas = top.get("$defs", {})
    build = app.openapi

    def openapi() -> dict[str, Any]:
        doc = build()   # FastAPI caches it on app.openapi_schema
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in extra_schemas.items():
            if schemas.setdefault(name, schema) != schema:
                raise RuntimeError(f"two OpenAPI components are named {name}: rename one of the models")
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
