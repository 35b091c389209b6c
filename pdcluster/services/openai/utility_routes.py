"""The endpoints a vLLM user expects besides generation; behind the API key
like /v1/* (auth.py: only /health and /openapi.json are open).

    POST /tokenize      a prompt or a chat -> its token ids (tokenize.py)
    POST /detokenize    token ids -> their text
    GET  /metrics       Prometheus text: the gateway's counters and histograms,
                        admission, and every replica's KV and prefix-cache
                        numbers from the status board (gateway_metrics.py)
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pdcluster.services.openai.host import host_of, resolve_model
from pdcluster.services.openai.intake import read_body, read_request
from pdcluster.services.openai.openapi import error_responses, request_body
from pdcluster.services.openai.responses import DetokenizeResponse, TokenizeResponse
from pdcluster.services.openai.tokenize import (
    DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, detokenize, parse_tokenize_request, token_strs,
    tokenize,
)

router = APIRouter()
REQUEST_MODELS = [TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest]
_INPUT_ERRORS = error_responses(400, 404, 413, 500, 503)


@router.post("/tokenize", openapi_extra=request_body(TokenizeCompletionRequest, TokenizeChatRequest),
             responses={200: {"model": TokenizeResponse}, **_INPUT_ERRORS})
async def create_tokenize(request: Request) -> Response:
    host = host_of(request)
    req = parse_tokenize_request(await read_body(request, host.settings.max_body_bytes))
    resolve_model(req.model, host.settings)
    max_model_len = host.backend.max_model_len
    ids = await tokenize(host.tokenizer, req, max_model_len)
    strs = await token_strs(host.tokenizer, ids) if req.return_token_strs else None
    body = TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)
    return Response(body.model_dump_json(), media_type="application/json")


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
             responses={200: {"model": DetokenizeResponse}, **_INPUT_ERRORS})
async def create_detokenize(request: Request) -> Response:
    host = host_of(request)
    req = await read_request(request, DetokenizeRequest, host.settings.max_body_bytes)
    resolve_model(req.model, host.settings)
    body = DetokenizeResponse(prompt=await detokenize(host.tokenizer, req.tokens))
    return Response(body.model_dump_json(), media_type="application/json")


@router.get("/metrics", response_class=PlainTextResponse, responses={
    200: {"description": "Prometheus text exposition format"}, **error_responses(500, 503)})
async def prometheus_metrics(request: Request) -> Response:
    return Response(await host_of(request).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
