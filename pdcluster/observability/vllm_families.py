"""vLLM's metric families, written from what the cluster measures, so
dashboards, alerts and inference gateways built for vLLM read pdcluster
unchanged.  Names, types, units, buckets and the ``model_name`` label are
vLLM v1's (vllm/v1/metrics/loggers.py); ``engine`` is not written (one
gateway speaks for many engines).

    family                              type       cluster-wide source        per pool (pool="prefill"|...)
    vllm:num_requests_running           gauge      sum over replicas          sum over the pool's replicas
    vllm:num_requests_waiting           gauge      (status board: waiting     (the same)
                                                    + awaiting KV)
    vllm:kv_cache_usage_perc            gauge      used / total blocks, 0..1  the pool's used / total
    vllm:prompt_tokens_total            counter    gateway: prompts that got  engine intake: computed + cached
                                                    a first token             (decode counts pulled tokens too)
    vllm:generation_tokens_total        counter    gateway: tokens streamed   -
    vllm:prefix_cache_queries_total     counter    gateway: prompt tokens     engine: prompt tokens taken in
    vllm:prefix_cache_hits_total        counter    gateway: cached tokens     engine: prefix-cache hit tokens
    vllm:time_to_first_token_seconds    histogram  gateway (client's view)    -
    vllm:inter_token_latency_seconds    histogram  gateway: every gap between -
                                                    token-bearing chunks
    vllm:e2e_request_latency_seconds    histogram  gateway: arrival to finish -
    vllm:request_queue_time_seconds     histogram  every engine queue a       that pool's engines (a
                                                    request waited in         disaggregated request queues
                                                                              in prefill and in decode)
    vllm:cache_config_info              gauge = 1  block_size, cache_dtype,   num_gpu_blocks of the pool
                                                    num_gpu_blocks (all)

A series without ``pool`` is the cluster; per-pool series carry ``pool``.
Summing across both double-counts: select ``pool=""`` (the cluster) or
``pool!=""`` (the pools).  Counters summed over replicas drop when a replica
goes away; Prometheus's rate() reads a drop as a reset."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.core import Metric

from pdcluster.observability.histogram import CumulativeHistogram, merged

# vLLM v1's buckets, boundary for boundary.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)   # e2e and queue time

FAMILY_TYPES: dict[str, str] = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}
_DOCS = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed (queued or awaiting KV).",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:cache_config_info": "Information of the LLMEngine CacheConfig",
}


@dataclass
class GatewayTally:
    """The gateway's own measurements of the requests it relayed."""
    ttft: CumulativeHistogram
    inter_token: CumulativeHistogram
    e2e: CumulativeHistogram
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0

    @classmethod
    def empty(cls) -> "GatewayTally":
        return cls(CumulativeHistogram(TTFT_BUCKETS), CumulativeHistogram(INTER_TOKEN_BUCKETS),
                   CumulativeHistogram(REQUEST_LATENCY_BUCKETS))


@dataclass(frozen=True)
class _Pool:
    """One pool's (or the cluster's) sums over its replicas' statuses."""
    running: float = 0
    waiting: float = 0
    blocks_used: float = 0
    blocks_total: float = 0
    prompt_tokens: float = 0
    cached_tokens: float = 0


_STATUS_NUMBERS = ("running", "waiting", "awaiting_kv", "kv_blocks_total", "kv_blocks_free",
                   "prompt_tokens_computed", "prompt_tokens_cached")


def _usable(s: dict) -> bool:
    return isinstance(s.get("role"), str) and all(
        isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool) for k in _STATUS_NUMBERS)


def _add(p: _Pool, s: dict) -> _Pool:
    return _Pool(p.running + s["running"], p.waiting + s["waiting"] + s["awaiting_kv"],
                 p.blocks_used + s["kv_blocks_total"] - s["kv_blocks_free"], p.blocks_total + s["kv_blocks_total"],
                 p.prompt_tokens + s["prompt_tokens_computed"] + s["prompt_tokens_cached"],
                 p.cached_tokens + s["prompt_tokens_cached"])


def _queue_time(s: dict) -> CumulativeHistogram | None:
    try:
        return CumulativeHistogram.from_snapshot(s["queue_time_s"])
    except (KeyError, TypeError, ValueError):
        return None


def vllm_families(model_name: str, block_size: int, tally: GatewayTally,
                  statuses: Iterable[dict] | None, prefix_caching: bool = True) -> list[Metric]:
    """Every family above.  ``statuses``: the replicas' board statuses, None
    when the board is unreadable (then the board-fed families carry no
    samples rather than zeros: unknown is not idle).  A malformed status is
    skipped."""
    f = {name: Metric(name, _DOCS[name], kind) for name, kind in FAMILY_TYPES.items()}
    cluster = {"model_name": model_name}
    _counter(f["vllm:prompt_tokens"], cluster, tally.prompt_tokens)
    _counter(f["vllm:generation_tokens"], cluster, tally.generation_tokens)
    _counter(f["vllm:prefix_cache_queries"], cluster, tally.prompt_tokens)
    _counter(f["vllm:prefix_cache_hits"], cluster, tally.cached_prompt_tokens)
    _histogram(f["vllm:time_to_first_token_seconds"], cluster, tally.ttft)
    _histogram(f["vllm:inter_token_latency_seconds"], cluster, tally.inter_token)
    _histogram(f["vllm:e2e_request_latency_seconds"], cluster, tally.e2e)
    if statuses is None:
        return list(f.values())
    usable = [s for s in statuses if _usable(s)]
    pools: dict[str, _Pool] = {}
    total = _Pool()
    dtypes = sorted({str(s.get("kv_dtype", "auto")) for s in usable}) or ["auto"]
    for s in usable:
        pools[s["role"]] = _add(pools.get(s["role"], _Pool()), s)
        total = _add(total, s)
    for labels, p in [(cluster, total)] + [({**cluster, "pool": r}, p) for r, p in sorted(pools.items())]:
        f["vllm:num_requests_running"].add_sample("vllm:num_requests_running", labels, p.running)
        f["vllm:num_requests_waiting"].add_sample("vllm:num_requests_waiting", labels, p.waiting)
        f["vllm:kv_cache_usage_perc"].add_sample("vllm:kv_cache_usage_perc", labels,
                                                 p.blocks_used / p.blocks_total if p.blocks_total else 0.0)
        f["vllm:cache_config_info"].add_sample("vllm:cache_config_info", {
            **labels, "block_size": str(block_size), "cache_dtype": ",".join(dtypes),
            "enable_prefix_caching": str(prefix_caching), "num_gpu_blocks": str(int(p.blocks_total))}, 1.0)
        roles = [s for s in usable if "pool" not in labels or s["role"] == labels["pool"]]
        _histogram(f["vllm:request_queue_time_seconds"], labels,
                   merged(REQUEST_LATENCY_BUCKETS, filter(None, map(_queue_time, roles))))
        if "pool" in labels:
            _counter(f["vllm:prompt_tokens"], labels, p.prompt_tokens)
            _counter(f["vllm:prefix_cache_queries"], labels, p.prompt_tokens)
            _counter(f["vllm:prefix_cache_hits"], labels, p.cached_tokens)
    return list(f.values())


def _counter(family: Metric, labels: dict[str, str], value: float) -> None:
    family.add_sample(family.name + "_total", labels, value)


def _histogram(family: Metric, labels: dict[str, str], h: CumulativeHistogram) -> None:
    for le, n in h.cumulative():
        family.add_sample(family.name + "_bucket", {**labels, "le": le}, n)
    family.add_sample(family.name + "_count", labels, h.count)
    family.add_sample(family.name + "_sum", labels, h.sum)
