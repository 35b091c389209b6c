"""The OpenAI-compatible endpoints, installed on a FastAPI app whose host
(the gateway deployment, or a test) sets three attributes:

    app.state.backend          a services.backend.Backend
    app.state.tokenizer        a services.engine.tokenizer.Tokenizer (same model as the backend)
    app.state.openai_settings  an OpenAISettings (served names, body limit, block hashing, API keys)

``create_app()`` builds such an app; ``configure_app()`` sets the three.

    GET  /openapi.json         this API's OpenAPI document (see openapi.py)       open
    GET  /health               the backend's health (503 when it is not ok)      open
    GET  /v1/models            the served model names
    POST /v1/completions       prompt: a string or a list of token ids
    POST /v1/chat/completions  messages, through the model's chat template

With API keys in the settings every path but the open ones needs
``Authorization: Bearer <key>`` (auth.py).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from services import faults, telemetry
from services.openai.tracing import TracingMiddleware
from services.stage_telemetry import observe_gateway_stream
from services.backend import Backend, GenerateRequest
from services.engine.tokenizer import Tokenizer
from services.openai.auth import ApiKeyMiddleware
from services.openai.errors import OpenAIError, install_error_handlers
from services.openai.formats import ChatFormat, CompletionFormat, ResponseFormat, Tally
from services.openai.generation import complete, stream
from services.openai.intake import read_request
from services.openai.limits import check_limits
from services.openai.openapi import error_responses, generation_responses, install_openapi, request_body
from services.openai.prompt import fit_max_tokens, prompt_for
from services.openai.protocol import (
    AnyRequest, ChatCompletionRequest, CompletionRequest, reject_unsupported, requested_max_tokens,
    to_sampling_params,
)
from services.openai.request_id import RequestIdMiddleware
from services.openai.responses import (
    ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, ModelCard, ModelList,
)
from services.openai.settings import OpenAISettings

router = APIRouter()
_STARTED_AT = int(time.time())


def create_app(*, request_id_header: bool = True) -> FastAPI:
    """A FastAPI app with the OpenAI API installed; usable as a Ray Serve
    ``serve.ingress(create_app)`` builder."""
    app = FastAPI(title="pdcluster", docs_url=None, redoc_url=None)
    install_openai_api(app, request_id_header=request_id_header)
    return app


def install_openai_api(app: FastAPI, *, request_id_header: bool = True) -> None:
    """Routes, OpenAI-style error handlers, API keys and x-request-id.  Call
    before the app starts.  ``request_id_header=False`` when a proxy in front
    already echoes x-request-id (Ray Serve's does)."""
    app.add_middleware(ApiKeyMiddleware)  # innermost of the three: a 401 still gets its x-request-id and span
    app.add_middleware(RequestIdMiddleware, echo_header=request_id_header)
    app.add_middleware(TracingMiddleware)
    install_error_handlers(app, request_id_header=request_id_header)
    app.include_router(router)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest], [ChatCompletionChunk])


def configure_app(app: FastAPI, backend: Backend, tokenizer: Tokenizer, settings: OpenAISettings) -> None:
    app.state.backend, app.state.tokenizer, app.state.openai_settings = backend, tokenizer, settings


@dataclass(frozen=True)
class _Host:
    backend: Backend
    tokenizer: Tokenizer
    settings: OpenAISettings


def _host(request: Request) -> _Host:
    state = request.app.state
    parts = {name: getattr(state, name, None) for name in ("backend", "tokenizer", "openai_settings")}
    missing = [f"app.state.{name}" for name, value in parts.items() if value is None]
    if missing:
        raise OpenAIError(503, f"the gateway is not ready ({', '.join(missing)} not set yet); retry shortly",
                          type="server_error", code="not_ready", headers={"Retry-After": "1"})
    return _Host(parts["backend"], parts["tokenizer"], parts["openai_settings"])


def _resolve_model(requested: str | None, settings: OpenAISettings) -> str:
    names = settings.served_model_names
    if requested is None:
        return names[0]
    if requested not in names:
        raise OpenAIError(404, f"the model {requested!r} does not exist here; this server serves "
                               f"{', '.join(repr(n) for n in names)} (see GET /v1/models)",
                          param="model", code="model_not_found")
    return requested


_HEALTH_STATUS = {"content": {"application/json": {"schema": {"type": "object"}}}}


@router.get("/health", responses={
    200: {**_HEALTH_STATUS, "description": "the backend's status: ok"},
    503: {**_HEALTH_STATUS, "description": "the backend's status (not ok), or the gateway's error body"},
    **error_responses(500)})
async def health(request: Request) -> JSONResponse:
    status: dict[str, Any] = await _host(request).backend.health()
    return JSONResponse(status, status_code=200 if status.get("status") == "ok" else 503)


@router.get("/v1/models", responses=error_responses(500, 503))
async def list_models(request: Request) -> ModelList:
    host = _host(request)
    cards = [ModelCard(id=name, created=_STARTED_AT, owned_by=host.settings.owned_by,
                       max_model_len=host.backend.max_model_len) for name in host.settings.served_model_names]
    return ModelList(data=cards)


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
             responses=generation_responses(CompletionResponse, CompletionResponse))
async def create_completion(request: Request) -> Response:
    return await _generate(request, CompletionRequest)


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
             responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk))
async def create_chat_completion(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest)


async def _generate(request: Request, kind: type[CompletionRequest] | type[ChatCompletionRequest]) -> Response:
    host = _host(request)
    settings = host.settings
    req: AnyRequest = await read_request(request, kind, settings.max_body_bytes)
    check_limits(req)
    reject_unsupported(req)
    model = _resolve_model(req.model, settings)
    requested, max_tokens_param = requested_max_tokens(req)
    # Refuse bad sampling parameters before spending CPU on the prompt.
    to_sampling_params(req, 1 if requested is None else requested, max_tokens_param)

    prompt = await prompt_for(host.tokenizer, req, host.backend.max_model_len, settings.block_hash_seed,
                              settings.block_size)
    chat = isinstance(req, ChatCompletionRequest)
    default = settings.default_chat_max_tokens if chat else settings.default_completion_max_tokens
    max_tokens = fit_max_tokens(req, requested, max_tokens_param, len(prompt.token_ids),
                                host.backend.max_model_len, default)
    params = to_sampling_params(req, max_tokens, max_tokens_param)

    request_id: str = request.state.request_id
    # A client's own id may repeat; the backend's id must not.
    engine_id = f"{request_id}-{secrets.token_hex(4)}" if request.state.request_id_from_client else request_id
    telemetry.set_attrs({telemetry.REQUEST_ID: request_id, telemetry.ENGINE_ID: engine_id, "request.model": model,
                         "request.stream": bool(req.stream), "request.max_tokens": max_tokens})
    chunks = host.backend.generate(GenerateRequest(engine_id, prompt.token_ids, params, prompt.block_hashes,
                                                   telemetry.inject(), faults.parse(request.headers.get(faults.HEADER))))
    chunks = observe_gateway_stream(chunks, len(prompt.token_ids))  # TTFT/TPOT/E2E, finish reason on the root
    tally = Tally(prompt_tokens=len(prompt.token_ids))
    fmt: ResponseFormat = (ChatFormat(f"chatcmpl-{request_id}", int(time.time()), model) if chat
                           else CompletionFormat(f"cmpl-{request_id}", int(time.time()), model))
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return await stream(request, chunks, tally, fmt, include_usage)
    body = await complete(request, chunks, tally, fmt)
    return Response(body.model_dump_json(), media_type="application/json")
