"""Where a request meets its tenant's rate limits (pdcluster/services/openai/rate_limits.py):
once as it arrives (requests/s) and once its size is known (tokens/s).  A
refusal is a 429 naming the tenant and the limit, with Retry-After; every
answer is counted per tenant.  Tenants are labelled by name only when
configured: a trusted header's other names count as ``other`` (bounded
series)."""

from __future__ import annotations

from starlette.requests import Request

from pdcluster.observability import tracing
from pdcluster.services.config import DEFAULT_TENANT
from pdcluster.services.openai.rate_limits import RateRefusal, TenantRateLimits
from pdcluster.services.openai.errors import OpenAIError
from pdcluster.services.openai.host import Host


def tenant_of_request(request: Request) -> str:
    return getattr(request.state, "tenant", DEFAULT_TENANT)


def tenant_label(tenant: str, host: Host) -> str:
    return tenant if tenant == DEFAULT_TENANT or tenant in host.settings.tenant_names else "other"


def check_request_rate(request: Request, host: Host) -> str:
    """The request's tenant, after its requests/s limit let it in (else the 429)."""
    tenant = tenant_of_request(request)
    tracing.set_attrs({"request.tenant": tenant})
    limits: TenantRateLimits | None = getattr(request.app.state, "rate_limits", None)
    if limits:
        _refuse_if(limits.admit_request(tenant), host)
    return tenant


def check_token_rate(request: Request, host: Host, tenant: str, tokens: int) -> None:
    limits: TenantRateLimits | None = getattr(request.app.state, "rate_limits", None)
    if limits:
        _refuse_if(limits.admit_tokens(tenant, tokens), host)
    host.metrics.count_tenant(tenant_label(tenant, host), "admitted")


def tenant_priority(asked: int, tenant: str, host: Host) -> int:
    """The priority a request of ``tenant`` gets: the one it ``asked``, no more urgent
    than the tenant may ask (its min_priority)."""
    floor = host.settings.tenant_min_priority.get(tenant)
    return asked if floor is None else max(asked, floor)


def _refuse_if(refusal: RateRefusal | None, host: Host) -> None:
    if refusal is None:
        return
    host.metrics.count_tenant(tenant_label(refusal.tenant, host), "rate_limited")
    raise OpenAIError(429, refusal.message, type="rate_limit_error", code="rate_limit_exceeded",
                      headers={"Retry-After": refusal.retry_after_header})
