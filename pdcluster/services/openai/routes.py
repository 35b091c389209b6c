"""The OpenAI-compatible endpoints, installed on a FastAPI app whose host
(the gateway deployment, or a test) sets what host.py lists: the backend,
its tokenizer, the OpenAISettings and the gateway's metrics registry.

``create_app()`` builds such an app; ``configure_app()`` sets those.

    GET  /openapi.json            this API's OpenAPI document (see openapi.py)       open
    GET  /health                  the backend's health (503 when it is not ok)      open
    GET  /live, /ready            Kubernetes' liveness and readiness, in probes.py   open
    GET  /v1/models               the served model names
    GET  /v1/models/{model_id}    one model's card, or 404
    POST /v1/completions          prompt: a string or a list of token ids
    POST /v1/chat/completions     messages, through the model's chat template
    POST /tokenize, /detokenize   vLLM's, in utility_routes.py
    GET  /metrics                 Prometheus text, in utility_routes.py

With API keys in the settings every path but the open ones needs
``Authorization: Bearer <key>`` (auth.py), /metrics included.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from pdcluster.services.pools import faults

from pdcluster.observability import tracing
from pdcluster.services.openai.tracing import TracingMiddleware
from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.backend import Backend
from pdcluster.services.tokenizer import Tokenizer
from pdcluster.services.openai.rate_limits import TenantRateLimits
from pdcluster.services.openai.auth import ApiKeyMiddleware
from pdcluster.services.openai.tenant_limits import check_request_rate, check_token_rate, tenant_label, tenant_priority
from pdcluster.services.openai.choices import generate_choices
from pdcluster.services.openai.echo import echo_of, prompt_only, scoring_request
from pdcluster.services.openai.errors import install_error_handlers
from pdcluster.services.openai.formats import ChatFormat, CompletionFormat, ResponseFormat, Tally
from pdcluster.services.openai.gateway_metrics import EndpointLabels, GatewayMetrics, ResponseCounter
from pdcluster.services.openai.generation import complete, stream
from pdcluster.services.openai.host import host_of, resolve_model
from pdcluster.services.openai.intake import read_request
from pdcluster.services.openai.limits import check_limits
from pdcluster.services.openai.logprobs_format import LogprobRenderer
from pdcluster.services.openai.openapi import error_responses, generation_responses, install_openapi, request_body
from pdcluster.services.openai.prompt import check_prompt_fits, fit_max_tokens, prompt_for
from pdcluster.services.openai.protocol import (
    AnyRequest, ChatCompletionRequest, CompletionRequest, reject_unsupported, requested_max_tokens,
    check_sampling_params, to_sampling_params,
)
from pdcluster.services.openai.request_id import RequestIdMiddleware
from pdcluster.services.openai.responses import (
    ChatCompletionChunk, ChatCompletionResponse, CompletionResponse, ModelCard, ModelList,
)
from pdcluster.services.messages import GenerateRequest
from pdcluster.services.openai.settings import OpenAISettings
from pdcluster.services.openai.tool_calls import ToolCallFormat, constraint_off_loop
from pdcluster.services.openai.utility_routes import REQUEST_MODELS as UTILITY_REQUEST_MODELS
from pdcluster.services.openai.utility_routes import router as utility_router
from pdcluster.services.openai.probes import router as probe_router
from pdcluster.services.openai.drain import Drain, DrainGate

router = APIRouter()
_STARTED_AT = int(time.time())


def create_app(*, request_id_header: bool = True) -> FastAPI:
    """A FastAPI app with the OpenAI API installed; usable as a Ray Serve
    ``serve.ingress(create_app)`` builder."""
    app = FastAPI(title="pdcluster", docs_url=None, redoc_url=None)
    install_openai_api(app, request_id_header=request_id_header)
    return app


def install_openai_api(app: FastAPI, *, request_id_header: bool = True) -> None:
    """Routes, OpenAI-style error handlers, API keys, x-request-id, tracing
    and the response counter of /metrics.  Call before the app starts.
    ``request_id_header=False`` when a proxy in front already echoes
    x-request-id (Ray Serve's does)."""
    app.add_middleware(ApiKeyMiddleware)  # innermost: a 401 still gets its x-request-id, span and count
    app.add_middleware(DrainGate)         # once draining, new requests get 503 (drain.py)
    app.state.drain = Drain()
    app.add_middleware(RequestIdMiddleware, echo_header=request_id_header)
    app.add_middleware(TracingMiddleware)
    endpoints = EndpointLabels([*router.routes, *utility_router.routes, *probe_router.routes], paths=[app.openapi_url or "/openapi.json"])
    app.add_middleware(ResponseCounter, endpoints=endpoints)   # outermost: counts 401s and Starlette's 500s too
    install_error_handlers(app, request_id_header=request_id_header)
    app.include_router(router)
    app.include_router(utility_router)
    app.include_router(probe_router)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, *UTILITY_REQUEST_MODELS], [ChatCompletionChunk])


def configure_app(app: FastAPI, backend: Backend, tokenizer: Tokenizer, settings: OpenAISettings,
                  metrics: GatewayMetrics | None = None, rate_limits: TenantRateLimits | None = None) -> None:
    """``metrics`` None: a registry of the app's own, with no status board or admission numbers.
    ``rate_limits``: the tenants' (none: no tenant is rate limited)."""
    app.state.backend, app.state.tokenizer, app.state.openai_settings = backend, tokenizer, settings
    app.state.rate_limits = rate_limits
    app.state.gateway_metrics = metrics if metrics is not None else GatewayMetrics(
        model_name=settings.served_model_names[0], block_size=settings.block_size)


_HEALTH_STATUS = {"content": {"application/json": {"schema": {"type": "object"}}}}


@router.get("/health", responses={
    200: {**_HEALTH_STATUS, "description": "the backend's status: ok"},
    503: {**_HEALTH_STATUS, "description": "the backend's status (not ok), or the gateway's error body"},
    **error_responses(500)})
async def health(request: Request) -> JSONResponse:
    status: dict[str, Any] = await host_of(request).backend.health()
    return JSONResponse(status, status_code=200 if status.get("status") == "ok" else 503)


def _model_card(name: str, backend: Backend, settings: OpenAISettings) -> ModelCard:
    return ModelCard(id=name, created=_STARTED_AT, owned_by=settings.owned_by, max_model_len=backend.max_model_len)


@router.get("/v1/models", responses=error_responses(500, 503))
async def list_models(request: Request) -> ModelList:
    host = host_of(request)
    names = host.settings.served_model_names
    return ModelList(data=[_model_card(name, host.backend, host.settings) for name in names])


# ``:path``: a served name may hold a slash (``org/model``), as the openai client sends it.  The
# parameter is read from path_params and described by hand: FastAPI would document a 422 we never answer.
_MODEL_ID = {"parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"},
                             "description": "a served model name (see GET /v1/models)"}]}


@router.get("/v1/models/{model_id:path}", openapi_extra=_MODEL_ID, responses=error_responses(404, 500, 503))
async def retrieve_model(request: Request) -> ModelCard:
    host = host_of(request)
    return _model_card(resolve_model(request.path_params["model_id"], host.settings), host.backend, host.settings)


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
             responses=generation_responses(CompletionResponse, CompletionResponse))
async def create_completion(request: Request) -> Response:
    return await _generate(request, CompletionRequest)


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
             responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk))
async def create_chat_completion(request: Request) -> Response:
    return await _generate(request, ChatCompletionRequest)


async def _generate(request: Request, kind: type[CompletionRequest] | type[ChatCompletionRequest]) -> Response:
    arrived_at = time.monotonic()
    host = host_of(request)
    settings = host.settings
    tenant = check_request_rate(request, host)   # a tenant over its requests/s: 429 before any work
    req: AnyRequest = await read_request(request, kind, settings.max_body_bytes)
    req, wants_prompt_only = scoring_request(req)   # echo with max_tokens 0
    check_limits(req)
    reject_unsupported(req)
    # Every input bound for the prompt (tools and tool calls too) counted, and one that can never fit
    # refused, before any grammar is built or template rendered.
    size = await check_prompt_fits(host.tokenizer, req, host.backend.max_model_len)
    # response_format / guided_* / tools: a grammar, or a 400 naming the field (checked off the event loop).
    guided, tools = await constraint_off_loop(req)
    model = resolve_model(req.model, settings)
    requested, max_tokens_param = requested_max_tokens(req)
    # Bad values refused before spending CPU on the prompt; the params are built once max_tokens is fitted.
    check_sampling_params(req, 1 if requested is None else requested, max_tokens_param)

    prompt = await prompt_for(host.tokenizer, req, host.backend.max_model_len, settings.block_hash_seed,
                              settings.block_size, size)
    chat = isinstance(req, ChatCompletionRequest)
    default = settings.default_chat_max_tokens if chat else settings.default_completion_max_tokens
    max_tokens = fit_max_tokens(req, requested, max_tokens_param, len(prompt.token_ids),
                                host.backend.max_model_len, default)
    check_token_rate(request, host, tenant, len(prompt.token_ids) + max_tokens * req.n)
    params = to_sampling_params(req, max_tokens, max_tokens_param, tenant=tenant, guided=guided,
                                priority=tenant_priority(req.priority, tenant, host))

    request_id: str = request.state.request_id
    # A client's own id may repeat; the backend's id must not.
    engine_id = f"{request_id}-{secrets.token_hex(4)}" if request.state.request_id_from_client else request_id
    tracing.set_attrs({tracing.REQUEST_ID: request_id, tracing.ENGINE_ID: engine_id, "request.model": model,
                         "request.stream": bool(req.stream), "request.max_tokens": max_tokens,
                         "request.priority": params.priority})
    routing = RoutingHeader(prompt.block_hashes, len(prompt.token_ids), settings.block_size, max_tokens)
    chunks = generate_choices(host.backend.generate, GenerateRequest(
        engine_id, prompt.token_ids, params, routing, tracing.inject(),
        faults.parse(request.headers.get(faults.HEADER), settings.fault_injection), arrived_at=arrived_at), req.n)
    if wants_prompt_only:
        chunks = prompt_only(chunks)
    # TTFT/TPOT/E2E for /metrics and Ray's, token counts and the finish reason on the root span
    chunks = host.metrics.observe_stream(chunks, len(prompt.token_ids), tenant_label(tenant, host),
                                         trace.get_current_span())
    tally = Tally(prompt_tokens=len(prompt.token_ids), n=req.n)
    logprobs = None if params.logprobs is None else LogprobRenderer(host.tokenizer, params.logprobs)
    include_usage = req.stream and req.stream_options is not None and req.stream_options.include_usage
    continuous_usage = include_usage and req.stream_options.continuous_usage_stats
    fmt: ResponseFormat = (
        ChatFormat(f"chatcmpl-{request_id}", int(time.time()), model, req.n, logprobs,
                   continuous_usage=continuous_usage) if chat
        else CompletionFormat(f"cmpl-{request_id}", int(time.time()), model, req.n, logprobs,
                              echo_of(host.tokenizer, req, prompt.token_ids), continuous_usage=continuous_usage))
    if tools is not None and tools.may_call and isinstance(fmt, ChatFormat):
        fmt = ToolCallFormat.around(fmt, tools)   # message.tool_calls, finish_reason "tool_calls"
    if req.stream:
        return await stream(request, chunks, tally, fmt, include_usage)
    body = await complete(request, chunks, tally, fmt)
    return Response(body.model_dump_json(), media_type="application/json")
