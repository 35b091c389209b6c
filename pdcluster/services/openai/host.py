"""What a route handler needs from the app's host (the gateway deployment,
or a test), read from ``app.state`` on every request:

    app.state.backend          a pdcluster.services.backend.Backend
    app.state.tokenizer        a pdcluster.services.tokenizer.Tokenizer (same model as the backend)
    app.state.openai_settings  an OpenAISettings (served names, body limit, block hashing, API keys)
    app.state.gateway_metrics  a GatewayMetrics (the gateway's own /metrics registry)

``routes.configure_app`` sets all four."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from pdcluster.services.backend import Backend
from pdcluster.services.tokenizer import Tokenizer
from pdcluster.services.openai.errors import OpenAIError
from pdcluster.services.openai.gateway_metrics import GatewayMetrics
from pdcluster.services.openai.settings import OpenAISettings

_REQUIRED = ("backend", "tokenizer", "openai_settings", "gateway_metrics")


@dataclass(frozen=True)
class Host:
    backend: Backend
    tokenizer: Tokenizer
    settings: OpenAISettings
    metrics: GatewayMetrics


def host_of(request: Request) -> Host:
    """The host's parts, or a 503 (retry shortly) while it has not set them yet."""
    state = request.app.state
    parts = {name: getattr(state, name, None) for name in _REQUIRED}
    missing = [f"app.state.{name}" for name, value in parts.items() if value is None]
    if missing:
        raise OpenAIError(503, f"the gateway is not ready ({', '.join(missing)} not set yet); retry shortly",
                          type="server_error", code="not_ready", headers={"Retry-After": "1"})
    return Host(*parts.values())


def resolve_model(requested: str | None, settings: OpenAISettings) -> str:
    """The served name ``requested`` (the first served name when None), or a 404."""
    names = settings.served_model_names
    if requested is None:
        return names[0]
    if requested not in names:
        raise OpenAIError(404, f"the model {requested!r} does not exist here; this server serves "
                               f"{', '.join(repr(n) for n in names)} (see GET /v1/models)",
                          param="model", code="model_not_found")
    return requested
