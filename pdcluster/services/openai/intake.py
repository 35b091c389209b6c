"""Reading a request body: the size limit first (before a byte is parsed),
then JSON, then the strict pydantic model -- each failure a 4xx that says
what to fix."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from pdcluster.services.openai.errors import OpenAIError, invalid_request, validation_error

M = TypeVar("M", bound=BaseModel)


def _too_large(max_bytes: int, size: int | None) -> OpenAIError:
    got = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
    return OpenAIError(413, f"request body is {got}; the limit is {max_bytes} bytes: "
                            "shorten the prompt or send token ids instead of text",
                       code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refusing (413) a declared or actual size over ``max_bytes``
    without buffering more than that."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise invalid_request(f"Content-Length {declared!r} is not a byte count")
        if int(declared) > max_bytes:
            raise _too_large(max_bytes, int(declared))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes, None)
            chunks.append(chunk)
    except ClientDisconnect:
        raise invalid_request("the client disconnected while sending the request body") from None
    return b"".join(chunks)


def parse_body(body: bytes, model: type[M]) -> M:
    if not body.strip():
        raise invalid_request("the request body is empty: send a JSON object", code="invalid_json")
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid_request(f"the request body is not valid JSON ({exc}): send a JSON object",
                              code="invalid_json") from None
    except RecursionError:
        raise invalid_request("the request body nests too deeply to parse", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise invalid_request(f"the request body must be a JSON object, got a JSON {type(obj).__name__}",
                              code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise validation_error(list(exc.errors(include_url=False))) from None


async def read_request(request: Request, model: type[M], max_bytes: int) -> M:
    return parse_body(await read_body(request, max_bytes), model)
