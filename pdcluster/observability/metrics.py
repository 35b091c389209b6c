"""The numbers operators watch, through ``ray.util.metrics`` so they show on
the Ray dashboard and its Prometheus endpoint, as ``ray_<name>`` (counters
``ray_<name>_total``; histograms ``_bucket``/``_count``/``_sum``), checked on Ray 2.60.

    name                                 kind       tag keys               recorded by
    pdcluster_ttft_seconds               histogram  pool                   gateway (client-seen), prefill, colocated
    pdcluster_tpot_seconds               histogram  pool                   gateway, decode, colocated
    pdcluster_e2e_seconds                histogram  pool                   gateway, prefill, decode, colocated
    pdcluster_queue_seconds              histogram  pool                   prefill, decode, colocated (engine queue)
    pdcluster_requests_running           gauge      pool, replica          each replica, every second
    pdcluster_requests_waiting           gauge      pool, replica          (waiting + awaiting KV)
    pdcluster_kv_blocks_used             gauge      pool, replica
    pdcluster_kv_blocks_total            gauge      pool, replica
    pdcluster_prompt_tokens              counter    pool, replica          hit rate = hit tokens / prompt tokens
    pdcluster_prefix_cache_hit_tokens    counter    pool, replica
    pdcluster_kv_transfer_bytes          counter    backend                decode replicas (pulled bytes)
    pdcluster_kv_transfer_seconds        counter    backend                bandwidth = rate(bytes) / rate(seconds)
    pdcluster_router_decisions           counter    pool, policy, outcome  outcome: cache_hit | load_only |
                                                                           no_header | index_degraded
    pdcluster_http_responses             counter    status_class           2xx | 3xx | 4xx | 429 | 5xx (429 not in 4xx)
    pdcluster_index_lookup_failures      counter    pool, reason           degraded | raised
    pdcluster_decode_pool_prefills       counter    reason                 gateway: whole requests sent to the
                                                                           decode pool in disaggregated mode;
                                                                           short_prompt | no_prefill_replica
    pdcluster_admission_rejections       counter    reason                 gateway: slo | in_flight_cap
    pdcluster_seat_waits                 counter    pool                   gateway: offers of an admitted request
                                                                           that every place's queue was too full
                                                                           to take (offered again, never a 429)
    pdcluster_deadlines_exceeded         counter    kind                   gateway: request | inter_token
    pdcluster_http_connections_closed    counter    reason                 gateway: head_timeout | body_timeout | connection_cap
                                                                           (pdcluster/services/gateway/http_protocol.py)
    pdcluster_lease_events               counter    event                  prefill: late_notification (a release
                                                                           for a lease already gone)
    pdcluster_failovers                  counter    reason                 gateway: streams resumed on another
                                                                           replica (pdcluster/services/gateway/failover.py reasons)
    pdcluster_task_crashes               counter    task                   any replica: a supervised background
                                                                           task ended unexpectedly (pdcluster/services/supervisor.py)

``pool`` is gateway | prefill | decode | colocated.  Metrics exist only in a
Ray driver or worker and are created on first use; anywhere else (unit
tests, the bare engine) every call here is a cheap no-op.  Recording never
raises into a request: a failure is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdcluster.observability.histogram import CumulativeHistogram
from pdcluster.observability.vllm_families import REQUEST_LATENCY_BUCKETS

log = logging.getLogger("pdcluster.metrics")

# Seconds.  TTFT spans cache hits (ms) to long queued prompts (tens of s).
TTFT_BOUNDARIES = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5,
                   10.0, 20.0, 30.0, 60.0)
TPOT_BOUNDARIES = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                   0.25, 0.5, 1.0)
E2E_BOUNDARIES = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_BOUNDARIES = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class MetricSpec:
    kind: str                      # "counter" | "gauge" | "histogram"
    description: str
    tag_keys: tuple[str, ...]
    boundaries: tuple[float, ...] = ()


_POOL, _REPLICA = ("pool",), ("pool", "replica")
SPECS: dict[str, MetricSpec] = {
    "pdcluster_ttft_seconds": MetricSpec("histogram", "Time to first token", _POOL, TTFT_BOUNDARIES),
    "pdcluster_tpot_seconds": MetricSpec("histogram", "Time per output token after the first", _POOL,
                                         TPOT_BOUNDARIES),
    "pdcluster_e2e_seconds": MetricSpec("histogram", "Request latency, arrival to last token", _POOL,
                                        E2E_BOUNDARIES),
    "pdcluster_queue_seconds": MetricSpec("histogram", "Time waiting in the engine's queue", _POOL,
                                          QUEUE_BOUNDARIES),
    "pdcluster_requests_running": MetricSpec("gauge", "Requests running in the engine", _REPLICA),
    "pdcluster_requests_waiting": MetricSpec("gauge", "Requests waiting (queue + awaiting KV)", _REPLICA),
    "pdcluster_kv_blocks_used": MetricSpec("gauge", "KV blocks in use", _REPLICA),
    "pdcluster_kv_blocks_total": MetricSpec("gauge", "KV blocks in the pool", _REPLICA),
    "pdcluster_prompt_tokens": MetricSpec("counter", "Prompt tokens received", _REPLICA),
    "pdcluster_prefix_cache_hit_tokens": MetricSpec("counter", "Prompt tokens found in the prefix cache",
                                                    _REPLICA),
    "pdcluster_kv_transfer_bytes": MetricSpec("counter", "KV bytes pulled between replicas", ("backend",)),
    "pdcluster_kv_transfer_seconds": MetricSpec("counter", "Seconds spent pulling KV", ("backend",)),
    "pdcluster_router_decisions": MetricSpec("counter", "Routing decisions", ("pool", "policy", "outcome")),
    "pdcluster_http_responses": MetricSpec("counter", "HTTP responses by status class", ("status_class",)),
    "pdcluster_index_lookup_failures": MetricSpec("counter", "Prefix index lookups that failed or degraded",
                                                  ("pool", "reason")),
    "pdcluster_decode_pool_prefills": MetricSpec(
        "counter", "Disaggregated requests prefilled on the decode pool (short prompt, or no live prefill replica)",
        ("reason",)),
    "pdcluster_admission_rejections": MetricSpec(
        "counter", "Requests refused at the gateway (predicted TTFT over the SLO, or the in-flight cap)",
        ("reason",)),
    "pdcluster_seat_waits": MetricSpec(
        "counter", "Admitted requests offered again because the pools' queues were full", ("pool",)),
    "pdcluster_deadlines_exceeded": MetricSpec("counter", "Requests aborted at a deadline", ("kind",)),
    "pdcluster_http_connections_closed": MetricSpec(
        "counter", "Client connections the gateway closed: no whole request head or body in time, or over its cap",
        ("reason",)),
    "pdcluster_lease_events": MetricSpec(
        "counter", "KV lease outcomes on prefill replicas besides a pull's release", ("event",)),
    "pdcluster_failovers": MetricSpec(
        "counter", "Streams resumed on another replica after losing their own", ("reason",)),
    "pdcluster_task_crashes": MetricSpec(
        "counter", "Supervised background tasks that ended unexpectedly (restarted, or health fails)", ("task",)),
}

_metrics: dict[str, Any] = {}
_warned: set[str] = set()


def ray_active() -> bool:
    """True inside a connected Ray driver or worker.  Checks sys.modules first
    so a process that never imported Ray doesn't pay for importing it."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _create(name: str) -> Any:
    from ray.util import metrics as ray_metrics

    spec = SPECS[name]
    if spec.kind == "histogram":
        return ray_metrics.Histogram(name, spec.description, boundaries=list(spec.boundaries),
                                     tag_keys=spec.tag_keys)
    cls = {"counter": ray_metrics.Counter, "gauge": ray_metrics.Gauge}[spec.kind]
    return cls(name, spec.description, tag_keys=spec.tag_keys)


def _record(name: str, value: float, tags: dict[str, str], method: str) -> None:
    if not ray_active():
        return
    try:
        metric = _metrics.get(name)
        if metric is None:
            metric = _metrics[name] = _create(name)
        getattr(metric, method)(value, tags=tags)
    except Exception as exc:  # noqa: BLE001 - metrics must never fail a request
        if name not in _warned:
            _warned.add(name)
            log.warning("recording metric %s failed: %r (further failures not logged)", name, exc)


def _observe(name: str, value: float, **tags: str) -> None:
    if value >= 0:
        _record(name, float(value), tags, "observe")


def _inc(name: str, value: float, **tags: str) -> None:
    if value > 0:  # Ray's Counter rejects 0
        _record(name, float(value), tags, "inc")


def _set(name: str, value: float, **tags: str) -> None:
    _record(name, float(value), tags, "set")


# ---- the API ------------------------------------------------------------------
def observe_ttft(pool: str, seconds: float) -> None:
    _observe("pdcluster_ttft_seconds", seconds, pool=pool)


def observe_tpot(pool: str, seconds: float) -> None:
    _observe("pdcluster_tpot_seconds", seconds, pool=pool)


def observe_e2e(pool: str, seconds: float) -> None:
    _observe("pdcluster_e2e_seconds", seconds, pool=pool)


def observe_queue(pool: str, seconds: float) -> None:
    _observe("pdcluster_queue_seconds", seconds, pool=pool)
    queue_times(pool).observe(seconds)


_QUEUE_TIMES: dict[str, CumulativeHistogram] = {}


def queue_times(pool: str) -> CumulativeHistogram:
    """This process's engine queue times in ``pool`` (with or without Ray):
    a replica publishes ``snapshot()`` in its board status, and the gateway
    sums them into ``vllm:request_queue_time_seconds`` (vllm_families.py)."""
    h = _QUEUE_TIMES.get(pool)
    if h is None:
        h = _QUEUE_TIMES[pool] = CumulativeHistogram(REQUEST_LATENCY_BUCKETS)
    return h


def set_engine_stats(pool: str, replica: str, stats: Any) -> None:
    """The four gauges from an ``EngineStats`` (duck-typed)."""
    _set("pdcluster_requests_running", stats.num_running, pool=pool, replica=replica)
    _set("pdcluster_requests_waiting", stats.num_waiting + stats.num_awaiting_kv, pool=pool, replica=replica)
    _set("pdcluster_kv_blocks_used", stats.kv_blocks_total - stats.kv_blocks_free, pool=pool, replica=replica)
    _set("pdcluster_kv_blocks_total", stats.kv_blocks_total, pool=pool, replica=replica)


async def export_gauges_forever(pool: str, replica: str, stats: Callable[[], Any], period_s: float = 1.0) -> None:
    """Sets the engine gauges every ``period_s`` (a replica background task;
    returns at once outside Ray)."""
    while ray_active():
        set_engine_stats(pool, replica, stats())
        await asyncio.sleep(period_s)


def count_prompt_tokens(pool: str, replica: str, prompt_tokens: int, cache_hit_tokens: int) -> None:
    _inc("pdcluster_prompt_tokens", prompt_tokens, pool=pool, replica=replica)
    _inc("pdcluster_prefix_cache_hit_tokens", cache_hit_tokens, pool=pool, replica=replica)


def count_transfer(backend: str, num_bytes: int, seconds: float) -> None:
    _inc("pdcluster_kv_transfer_bytes", num_bytes, backend=backend)
    _inc("pdcluster_kv_transfer_seconds", seconds, backend=backend)


def route_outcome(has_header: bool, index_degraded: bool, cached_tokens: int) -> str:
    """The ``outcome`` tag of one routing decision."""
    if not has_header:
        return "no_header"
    if cached_tokens > 0:
        return "cache_hit"
    return "index_degraded" if index_degraded else "load_only"


def count_route(pool: str, policy: str, outcome: str) -> None:
    _inc("pdcluster_router_decisions", 1, pool=pool, policy=policy, outcome=outcome)


def status_class(status: int) -> str:
    """429 gets its own class: overload is what operators act on."""
    return "429" if status == 429 else f"{status // 100}xx"


def count_http_response(status: int) -> None:
    _inc("pdcluster_http_responses", 1, status_class=status_class(status))


def count_decode_pool_prefill(reason: str) -> None:
    _inc("pdcluster_decode_pool_prefills", 1, reason=reason)


def count_admission_rejection(reason: str) -> None:
    _inc("pdcluster_admission_rejections", 1, reason=reason)


def count_seat_wait(pool: str) -> None:
    _inc("pdcluster_seat_waits", 1, pool=pool)


def count_deadline(kind: str) -> None:
    _inc("pdcluster_deadlines_exceeded", 1, kind=kind)


def count_http_connection_closed(reason: str) -> None:
    _inc("pdcluster_http_connections_closed", 1, reason=reason)


def count_lease_event(event: str) -> None:
    _inc("pdcluster_lease_events", 1, event=event)


def count_task_crash(task: str) -> None:
    _inc("pdcluster_task_crashes", 1, task=task)


def count_failover(reason: str) -> None:
    _inc("pdcluster_failovers", 1, reason=reason)


def count_index_lookup_failure(pool: str, reason: str) -> None:
    _inc("pdcluster_index_lookup_failures", 1, pool=pool, reason=reason)


class RequestTimer:
    """TTFT, TPOT and E2E of one request as one pool sees it:

        timer = RequestTimer("decode")      at arrival
        timer.on_tokens(n)                  per chunk of n new tokens
        timer.finish()                      on success (once; later calls no-op)
    """

    def __init__(self, pool: str, start_s: float | None = None, clock: Callable[[], float] = time.perf_counter):
        self.pool, self.clock = pool, clock
        self.start_s = clock() if start_s is None else start_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.num_tokens = 0
        self._done = False

    def on_tokens(self, n: int = 1) -> None:
        if n <= 0:
            return
        now = self.clock()
        if self.first_token_s is None:
            self.first_token_s = now
        self.last_token_s = now
        self.num_tokens += n

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Mean gap per token after the first (None with fewer than two)."""
        if self.num_tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_tokens - 1)

    def finish(self, *, ttft: bool = True) -> None:
        """``ttft=False`` where the pool did not produce the first token (decode)."""
        if self._done:
            return
        self._done = True
        if ttft and self.ttft_s is not None:
            observe_ttft(self.pool, self.ttft_s)
        if self.tpot_s is not None:
            observe_tpot(self.pool, self.tpot_s)
        observe_e2e(self.pool, self.clock() - self.start_s)


def _reset_for_tests() -> None:
    _metrics.clear()
    _QUEUE_TIMES.clear()
    _warned.clear()
