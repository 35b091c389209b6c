"""The gateway's own ``GET /metrics``, in Prometheus text format, without
Ray's dashboard or metrics agent.  One ``CollectorRegistry`` per app (never
prometheus_client's global one), so two apps in a process never mix numbers.

    name                                     kind       labels                  recorded
    pdcluster_http_responses_total           counter    endpoint, status_class  every answer (ResponseCounter)
    pdcluster_tenant_requests_total          counter    tenant, outcome         admitted / rate_limited / shed
                                                                                  (admission's 429: its SLO or its
                                                                                  share of the decode seats)
    pdcluster_tenant_ttft_seconds            histogram  tenant                  first token out, per tenant
    pdcluster_tenant_tokens_total            counter    tenant, kind            prompt / generation tokens
    pdcluster_tenant_kv_blocks               gauge      pool, replica, tenant   KV blocks in use or cached, per
                                                                                  tenant (the board; 16 largest)
    pdcluster_ttft_seconds                   histogram                          first token out to the client
    pdcluster_tpot_seconds                   histogram                          at the finish reason: mean gap
    pdcluster_e2e_seconds                    histogram                            after the first token, and
                                                                                  arrival to the finish reason
    pdcluster_generation_tokens_total        counter                            tokens streamed to clients
    pdcluster_admission_in_flight            gauge                              at scrape, from Admission.view()
    pdcluster_admission_rejections_total     counter    reason                  slo (shed) | in_flight_cap |
                                                                                  seat_share (a tenant's share of
                                                                                  the decode streams in the SLO)
    pdcluster_admission_queued_tokens        gauge      pool                    prompt tokens awaiting a first token
    pdcluster_admission_admitted_total       counter                            requests admitted
    pdcluster_admission_past_prediction_total counter                           of them: predicted over the SLO
                                                                                  (a fresh burst's short prompts)
    pdcluster_admission_prompt_tokens_total  counter                            their prompt tokens (any pool)
    pdcluster_failovers_total                counter    reason                  streams resumed on another replica
    pdcluster_kv_blocks_used                 gauge      pool, replica           at scrape, from the Redis status
    pdcluster_kv_blocks_total                gauge      pool, replica             board (StatusBoardReader: at most
    pdcluster_requests_running               gauge      pool, replica             1 s old; absent while Redis is
    pdcluster_requests_waiting               gauge      pool, replica             unreachable)
    pdcluster_prompt_tokens_total            counter    pool, replica           hit rate = hit tokens / prompt tokens
    pdcluster_prefix_cache_hit_tokens_total  counter    pool, replica
    pdcluster_kv_transfer_bytes_total        counter    pool, replica           KV pulled by a decode replica (its
    pdcluster_kv_transfer_seconds_total      counter    pool, replica             board counters)
    pdcluster_slo_requests_total             counter    outcome                 met | missed, at the finish reason
    pdcluster_slo_ttft_seconds               gauge                              the SLOs judged against (with slo=)
    pdcluster_slo_tpot_seconds               gauge
    vllm:*                                   (see pdcluster/observability/vllm_families.py: vLLM's own families,
                                              cluster-wide and per pool, from the gateway and the board)

Names and buckets are pdcluster/observability/metrics.py's where the meaning is the same
(Ray exports those as ``ray_<name>``, so the two never collide); the latency
histograms here are the client's view, Ray's ``pool="gateway"`` series.
``endpoint`` is the route's path template (``/v1/models/{model_id}``), and
``other`` for any path that is no route, so scanners cannot grow the label set.

Recording on the request path is O(1) and never raises into a request (a
failure is logged once).  With API keys set, /metrics needs one like /v1/*
(vLLM leaves it open; its numbers describe the operator's traffic): scrape
with ``authorization: {type: Bearer, credentials_file: ...}`` in prometheus.yml."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, Protocol

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.routing import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdcluster.observability import metrics
from pdcluster.observability import tracing as span_attrs
from pdcluster.observability.vllm_families import GatewayTally, vllm_families
from pdcluster.services.backend import BackendOverloaded
from pdcluster.services.openai.slo import Slo

log = logging.getLogger("pdcluster.metrics")

_REPLICA_LABELS = ("pool", "replica")
_BOARD_FIELDS = ("role", "name", "kv_blocks_total", "kv_blocks_free", "running", "waiting", "awaiting_kv",
                 "prompt_tokens_computed", "prompt_tokens_cached")
# name, kind, help, value from one replica's status (see pdcluster.services.pools.worker.Worker.status)
_BOARD_METRICS: tuple[tuple[str, str, str, Callable[[dict], float]], ...] = (
    ("pdcluster_kv_blocks_used", "gauge", "KV blocks in use", lambda s: s["kv_blocks_total"] - s["kv_blocks_free"]),
    ("pdcluster_kv_blocks_total", "gauge", "KV blocks in the pool", lambda s: s["kv_blocks_total"]),
    ("pdcluster_requests_running", "gauge", "Requests running in the engine", lambda s: s["running"]),
    ("pdcluster_requests_waiting", "gauge", "Requests waiting (queue + awaiting KV)",
     lambda s: s["waiting"] + s["awaiting_kv"]),
    ("pdcluster_prompt_tokens", "counter", "Prompt tokens the engine took in (computed + prefix-cache hits)",
     lambda s: s["prompt_tokens_computed"] + s["prompt_tokens_cached"]),
    ("pdcluster_prefix_cache_hit_tokens", "counter", "Prompt tokens found in the prefix cache",
     lambda s: s["prompt_tokens_cached"]),
    ("pdcluster_kv_transfer_bytes", "counter", "KV bytes this replica pulled from prefill replicas",
     lambda s: _counter_of(s, "bytes_pulled")),
    ("pdcluster_kv_transfer_seconds", "counter", "Seconds this replica spent pulling KV "
     "(throughput = rate(bytes) / rate(seconds))", lambda s: _counter_of(s, "transfer_seconds")),
)


def _counter_of(status: dict, name: str) -> float:
    value = (status.get("counters") or {}).get(name, 0)
    return value if _number(value) else 0


class StatusBoard(Protocol):
    def read(self) -> Awaitable[list[dict] | None]: ...


class GatewayMetrics:
    """``board``: where replica statuses come from (a replica_board.StatusBoardReader);
    ``admission_view``: ``Admission.view`` of the backend.  Either None: those
    metrics are absent."""

    def __init__(self, board: StatusBoard | None = None, admission_view: Callable[[], dict] | None = None,
                 failover_view: Callable[[], dict] | None = None, model_name: str = "", block_size: int = 16,
                 slo: Slo | None = None, prefix_caching: bool = True,
                 token_channel_view: Callable[[], dict] | None = None):
        self.board, self.admission_view = board, admission_view
        self.token_channel_view = token_channel_view  # the token inbox's counters (gateway/token_inbox.py)
        self.model_name, self.block_size = model_name, block_size
        self.tally = GatewayTally.empty()   # the vLLM families' gateway-side numbers (vllm_families.py)
        self.slo, self.prefix_caching = slo, prefix_caching
        self.failover_view = failover_view  # FailoverLog.view of the backend
        self.registry = CollectorRegistry()
        r = self.registry
        self._responses = Counter("pdcluster_http_responses", "HTTP responses by endpoint and status class",
                                  ("endpoint", "status_class"), registry=r)
        self._ttft = Histogram("pdcluster_ttft_seconds", "Time to first token, as the client sees it",
                               buckets=metrics.TTFT_BOUNDARIES, registry=r)
        self._tpot = Histogram("pdcluster_tpot_seconds", "Time per output token after the first, as the "
                               "client sees it", buckets=metrics.TPOT_BOUNDARIES, registry=r)
        self._e2e = Histogram("pdcluster_e2e_seconds", "Request latency, arrival to last token, as the client "
                              "sees it", buckets=metrics.E2E_BOUNDARIES, registry=r)
        self._generation_tokens = Counter("pdcluster_generation_tokens", "Tokens streamed to clients", registry=r)
        self._slo_requests = Counter("pdcluster_slo_requests", "Finished requests by whether they met the TTFT "
                                     "and TPOT SLOs (goodput = met / all)", ("outcome",), registry=r)
        for outcome in ("met", "missed"):
            self._slo_requests.labels(outcome)
        self._tenant_requests = Counter("pdcluster_tenant_requests", "Requests by tenant and outcome (admitted: "
                                        "past its rate limits; rate_limited: a 429)", ("tenant", "outcome"),
                                        registry=r)
        self._tenant_ttft = Histogram("pdcluster_tenant_ttft_seconds", "Time to first token by tenant, as the "
                                      "client sees it", ("tenant",), buckets=metrics.TTFT_BOUNDARIES, registry=r)
        self._tenant_tokens = Counter("pdcluster_tenant_tokens", "Prompt and generation tokens by tenant",
                                      ("tenant", "kind"), registry=r)
        self._statuses: list[dict] | None = None
        r.register(_ScrapeCollector(self))
        self._warned: set[str] = set()

    # ---- the request path: O(1), never raises ------------------------------------------------
    def count_response(self, endpoint: str, status: int) -> None:
        try:
            self._responses.labels(endpoint, metrics.status_class(status)).inc()
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a request
            self._warn_once("pdcluster_http_responses", exc)

    def count_tenant(self, tenant: str, outcome: str) -> None:
        try:
            self._tenant_requests.labels(tenant, outcome).inc()
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a request
            self._warn_once("pdcluster_tenant_requests", exc)

    def observe_stream(self, chunks: AsyncIterator[Any], num_prompt_tokens: int = 0,
                       tenant: str | None = None, root: trace.Span | None = None) -> AsyncIterator[Any]:
        """Wraps a TokenDelta stream (closing it closes ``chunks``), the one timer of a request at
        the gateway: TTFT and prompt tokens at the first token, inter-token gaps per chunk, TPOT,
        E2E and the SLO outcome at the finish reason (here and in Ray's metrics, pool "gateway"),
        tokens at the end; with ``tenant`` (a bounded label), its TTFT, tokens and admission 429s
        too; on the ``root`` span (the route's ``gateway.request``), the token counts and finish reason."""
        return self._observed(chunks, num_prompt_tokens, tenant, root)

    async def _observed(self, chunks: AsyncIterator[Any], num_prompt_tokens: int,
                        tenant: str | None, root: trace.Span | None) -> AsyncIterator[Any]:
        timer = metrics.RequestTimer("gateway")
        finished, cached, finish_reason = False, 0, None
        tally = self.tally
        try:
            async for chunk in chunks:
                first, last_s = timer.first_token_s is None, timer.last_token_s
                timer.on_tokens(len(chunk.token_ids))
                cached = max(cached, chunk.num_cached_tokens)
                if first and timer.ttft_s is not None:
                    self._record("pdcluster_ttft_seconds", self._ttft.observe, timer.ttft_s)
                    tally.ttft.observe(timer.ttft_s)
                    tally.prompt_tokens += num_prompt_tokens or chunk.num_prompt_tokens
                    if tenant is not None:
                        self._record("pdcluster_tenant_ttft_seconds", self._tenant_ttft.labels(tenant).observe,
                                     timer.ttft_s)
                        self._record("pdcluster_tenant_tokens", self._tenant_tokens.labels(tenant, "prompt").inc,
                                     num_prompt_tokens or chunk.num_prompt_tokens)
                elif chunk.token_ids and last_s is not None:
                    tally.inter_token.observe(timer.last_token_s - last_s)
                if chunk.finish_reason is not None and not finished:
                    finished, finish_reason = True, chunk.finish_reason
                    timer.finish()  # Ray's gateway-pool histograms, now: the consumer may close us after this chunk
                    if timer.tpot_s is not None:
                        self._record("pdcluster_tpot_seconds", self._tpot.observe, timer.tpot_s)
                    e2e_s = timer.clock() - timer.start_s
                    self._record("pdcluster_e2e_seconds", self._e2e.observe, e2e_s)
                    tally.e2e.observe(e2e_s)
                    if self.slo is not None:
                        self._slo_requests.labels(self.slo.outcome(timer.ttft_s, timer.tpot_s)).inc()
                yield chunk
        except BackendOverloaded:
            if tenant is not None and timer.first_token_s is None:
                self.count_tenant(tenant, "shed")
            raise
        finally:
            if root is not None:
                span_attrs.set_attrs({span_attrs.PROMPT_TOKENS: num_prompt_tokens, span_attrs.CACHED_TOKENS: cached,
                                      span_attrs.OUTPUT_TOKENS: timer.num_tokens,
                                      span_attrs.FINISH_REASON: finish_reason}, span=root)
            tally.cached_prompt_tokens += cached if timer.num_tokens else 0
            if timer.num_tokens:
                tally.generation_tokens += timer.num_tokens
                self._record("pdcluster_generation_tokens", self._generation_tokens.inc, timer.num_tokens)
                if tenant is not None:
                    self._record("pdcluster_tenant_tokens", self._tenant_tokens.labels(tenant, "generation").inc,
                                 timer.num_tokens)
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()   # closing the inner stream is what aborts the request

    def _record(self, name: str, record: Callable[[float], None], value: float) -> None:
        try:
            record(value)
        except Exception as exc:  # noqa: BLE001 - metrics must never fail a request
            self._warn_once(name, exc)

    def _warn_once(self, name: str, exc: Exception) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning("recording metric %s failed: %r (further failures not logged)", name, exc)

    # ---- the scrape -----------------------------------------------------------------------
    async def exposition(self) -> bytes:
        """The text a scrape gets; reads the status board first (cached)."""
        self._statuses = await self.board.read() if self.board is not None else None
        return generate_latest(self.registry)


class _ScrapeCollector:
    """The metrics read at scrape time: the admission counters and the
    replicas' board.  A malformed status skips that replica, never the scrape."""

    def __init__(self, owner: GatewayMetrics):
        self.owner = owner

    def describe(self) -> list[Metric]:
        return []   # built per scrape; nothing to check for clashes at registration

    def collect(self) -> Iterator[Metric]:
        owner = self.owner
        yield from vllm_families(owner.model_name, owner.block_size, owner.tally, owner._statuses,
                                 owner.prefix_caching)
        if owner.slo is not None:
            yield GaugeMetricFamily("pdcluster_slo_ttft_seconds", "The TTFT SLO goodput is counted against",
                                    value=owner.slo.ttft_s)
            yield GaugeMetricFamily("pdcluster_slo_tpot_seconds", "The TPOT SLO goodput is counted against",
                                    value=owner.slo.tpot_s)
        if self.owner.admission_view is not None:
            try:
                yield from _admission_families(self.owner.admission_view())
            except Exception as exc:  # noqa: BLE001 - one bad source must not empty the scrape
                self.owner._warn_once("pdcluster_admission", exc)
        if self.owner._statuses is not None:
            yield from _board_families(self.owner._statuses)
        if self.owner.failover_view is not None:
            try:
                yield _failover_family(self.owner.failover_view())
            except Exception as exc:  # noqa: BLE001 - one bad source must not empty the scrape
                self.owner._warn_once("pdcluster_failovers", exc)
        if self.owner.token_channel_view is not None:
            yield from _token_channel_families(self.owner.token_channel_view())


def _token_channel_families(view: dict) -> list[Metric]:
    frames = CounterMetricFamily("pdcluster_token_channel_frames", "Streamed deltas the engine replicas sent "
                                 "this gateway over the token channel: delivered to a stream, dropped (the "
                                 "stream had ended), malformed (its connection closed)", labels=("outcome",))
    frames.add_metric(("delivered",), view["frames"])
    frames.add_metric(("dropped",), view["dropped"])
    frames.add_metric(("malformed",), view["bad_frames"])
    connections = CounterMetricFamily("pdcluster_token_channel_connections", "Engine replicas' connections to "
                                      "this gateway's token inbox: accepted, or refused at the challenge",
                                      labels=("outcome",))
    connections.add_metric(("accepted",), view["connections"])
    connections.add_metric(("refused",), view["refused"])
    return [frames, connections]


def _failover_family(view: dict) -> Metric:
    family = CounterMetricFamily("pdcluster_failovers", "Streams resumed on another replica after losing their "
                                 "own, by reason (pdcluster/services/gateway/failover.py)", labels=("reason",))
    for reason, count in sorted(view["resumed"].items()):
        family.add_metric((reason,), count)
    return family


def _admission_families(view: dict) -> list[Metric]:
    in_flight = GaugeMetricFamily("pdcluster_admission_in_flight", "Requests admitted and not yet finished",
                                  value=view["in_flight"])
    rejections = CounterMetricFamily("pdcluster_admission_rejections", "Requests refused at the gateway "
                                     "(predicted TTFT over the SLO, or the in-flight cap)", labels=("reason",))
    rejections.add_metric(("slo",), view["shed"])
    rejections.add_metric(("in_flight_cap",), view["over_capacity"])
    rejections.add_metric(("seat_share",), view.get("seat_share", 0))
    queued = GaugeMetricFamily("pdcluster_admission_queued_tokens", "Prompt tokens (with per-request overhead) "
                               "admitted to a pool and awaiting their first token", labels=("pool",))
    for pool, rate in sorted(view.get("pools", {}).items()):
        queued.add_metric((pool,), rate["queued_tokens"])
    admitted = CounterMetricFamily("pdcluster_admission_admitted", "Requests admitted to a pool",
                                   value=view.get("admitted", 0))
    past = CounterMetricFamily("pdcluster_admission_past_prediction", "Requests admitted although predicted over "
                               "the TTFT SLO: short prompts of a burst onto an idle place "
                               "(pdcluster/services/gateway/placement.py)", value=view.get("past_prediction", 0))
    prompt = CounterMetricFamily("pdcluster_admission_prompt_tokens", "Prompt tokens of the admitted requests, "
                                 "whichever pool prefills them", value=view.get("admitted_prompt_tokens", 0))
    return [in_flight, rejections, queued, admitted, past, prompt]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _board_families(statuses: Iterable[dict]) -> list[Metric]:
    families = [(GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=_REPLICA_LABELS)
                for name, kind, doc, _ in _BOARD_METRICS]
    tenants = GaugeMetricFamily("pdcluster_tenant_kv_blocks", "KV blocks in use or cached, charged to each tenant "
                                "(a replica's 16 largest, the rest as other)", labels=(*_REPLICA_LABELS, "tenant"))
    for s in statuses:
        if not all(k in s for k in _BOARD_FIELDS) or not all(_number(s[k]) for k in _BOARD_FIELDS[2:]):
            continue
        labels = (str(s["role"]), str(s["name"]))
        for family, (_, _, _, value) in zip(families, _BOARD_METRICS):
            family.add_metric(labels, value(s))
        charged = s.get("tenant_kv_blocks")
        if isinstance(charged, dict):
            for tenant, n in list(charged.items())[:17]:
                if _number(n):
                    tenants.add_metric((*labels, str(tenant)[:64]), n)
    return families + [tenants]


class EndpointLabels:
    """Path -> the ``endpoint`` label: the matching route's path template, or
    ``other``.  A dict lookup for plain paths; templated routes are few.
    ``routes``: Starlette routes (an APIRouter's); ``paths``: more plain paths."""

    def __init__(self, routes: Iterable[Any], paths: Iterable[str] = ()):
        self._exact: dict[str, str] = {path: path for path in paths}
        self._templated: list[tuple[re.Pattern, str]] = []
        for route in routes:
            path = getattr(route, "path", None)
            if not isinstance(path, str):
                continue
            if "{" in path:
                self._templated.append((route.path_regex, route.path_format))
            else:
                self._exact[path] = path

    def __call__(self, path: str) -> str:
        label = self._exact.get(path)
        if label is not None:
            return label
        return next((fmt for regex, fmt in self._templated if regex.match(path)), "other")


class ResponseCounter:
    """Pure ASGI middleware: counts every answer in ``app.state.gateway_metrics``
    by endpoint and status class (an exception without a response counts as
    the 500 Starlette answers).  Install outside the API-key check, so 401s
    count under the endpoint they were refused at."""

    def __init__(self, app: ASGIApp, endpoints: EndpointLabels):
        self.app, self.endpoints = app, endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = scope.get("app")
        sink: GatewayMetrics | None = getattr(getattr(app, "state", None), "gateway_metrics", None)
        if scope["type"] != "http" or sink is None:
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def send_seeing_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_seeing_status)
        except Exception:
            status = status or 500
            raise
        finally:
            if status is not None:
                sink.count_response(self.endpoints(get_route_path(scope)), status)
