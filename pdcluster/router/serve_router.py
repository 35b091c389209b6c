"""The Ray Serve request router for the prefill and decode pools.

Per request (all on the router's event loop, nothing blocks it):

    header  = routing_header_of(args)                    block hashes from the gateway
    matches = await index.lookup(header.block_hashes)    one Redis round trip, bounded; or the
                                                         answer admission got for the same request
                                                         a moment ago (prefix_store/recent_lookups.py)
    loads   = in-flight tracked here + replica.routing_stats (rate, free KV)
    ranked  = policy.choose(snapshot).ranked             pure function
    return [[r] for r in ranked]                         Serve falls through when full

Configure a deployment with ``request_router_config(pool=..., index_url=...)``
(or ``RequestRouterConfig(request_router_class=PrefixAwareRequestRouter,
request_router_kwargs=...)``); the kwargs are ``initialize_state``'s.
Replicas report ``ReplicaStats`` from ``record_routing_stats`` and their
index worker name there or from ``record_replica_metadata``.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pdcluster.prefix_store.index import LookupResult, PrefixIndex, make_index
from pdcluster.prefix_store.url_reference import resolve_index_url
from pdcluster.router.inflight import InFlightTracker
from pdcluster.router.policy import RoutingPolicy, make_policy
from pdcluster.router.replica_stats import WORKER_NAME_KEY, ReplicaStats
from pdcluster.router.routing_header import RoutingHeader, routing_header_of
from pdcluster.router.snapshot import (
    DEFAULT_BLOCK_LOAD_S, ReplicaLoad, RequestShape, RoutingDecision, RoutingSnapshot, tier_load_s,
)

log = logging.getLogger(__name__)
DEFAULT_POLICY = {"prefill": "cache_aware", "decode": "decode_by_kv"}


@dataclass
class RouterCounters:
    decisions: int = 0
    without_header: int = 0
    lookups: int = 0             # asked of the index
    shared_lookups: int = 0      # admission's answer taken instead (prefix_store/recent_lookups.py)
    degraded_lookups: int = 0
    cache_routed: int = 0        # chosen replica holds >= 1 block of the prompt


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(
        self, pool: str = "prefill", policy: str | None = None, policy_options: dict | None = None,
        index_url: str | None = None, cluster: str = "local", model: str = "default",
        lookup_timeout_s: float = 0.05, default_prefill_tokens_per_s: float = 2000.0,
        default_free_kv_blocks: int = 0, inflight_ttl_s: float = 600.0,
        index: PrefixIndex | None = None, block_load_s: dict[str, float] | None = None,
        peer_pull_s_per_block: float | None = None, **_: Any,
    ) -> None:
        """``index_url``: ``redis://host:port``, or a reference to it (pdcluster/services/index_url_ref.py;
        None: route by load only).  ``index``:
        an index object instead of a URL, for in-process use and tests.  ``block_load_s``:
        seconds to load one block from a replica's ``host`` / ``disk`` tier (pdcluster/router/snapshot.py).
        ``peer_pull_s_per_block``: set when replicas pull prefixes from their peers (pdcluster/router/peer_fetch.py)."""
        if pool not in DEFAULT_POLICY:
            raise ValueError(f"router pool {pool!r} is unknown: use 'prefill' or 'decode'")
        self.pool = pool
        self.policy: RoutingPolicy = make_policy(policy or DEFAULT_POLICY[pool], **(policy_options or {}))
        self._index_url = resolve_index_url(index_url)  # Serve's config holds a reference (index_url_ref.py)
        self._index_options = {"cluster": cluster, "model": model}
        self._lookup_timeout_s = lookup_timeout_s
        self._index: PrefixIndex | None = index
        self.default_prefill_tokens_per_s = default_prefill_tokens_per_s
        self.default_free_kv_blocks = default_free_kv_blocks
        self.block_load_s = {**DEFAULT_BLOCK_LOAD_S, **(block_load_s or {})}
        self.peer_pull_s_per_block = peer_pull_s_per_block
        self.inflight = InFlightTracker(ttl_s=inflight_ttl_s)
        self.counters = RouterCounters()
        self.last_decision: RoutingDecision | None = None

    # -- Serve hooks -----------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Back off between rounds when every ranked replica is full.
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        started_ns = time.time_ns()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        header = None
        if pending_request is not None:
            header = routing_header_of(pending_request.args)
        if header is None:
            self.counters.without_header += 1
        elif header.target_worker is not None:
            # About state one replica holds: that replica or none (the caller bounds the wait).
            return [[r] for r in candidate_replicas if self.worker_name(r) == header.target_worker][:1]
        elif header.prefer_worker is not None:
            # State one replica probably holds (choice 0's prompt blocks): that replica while it
            # is live; gone, any replica can recompute it.
            preferred = [r for r in candidate_replicas if self.worker_name(r) == header.prefer_worker]
            if preferred:
                return [preferred[:1]]
        if header is not None and header.avoid_workers:
            # A failover: never back onto a replica the stream lost (Serve may not know it died
            # yet).  None left: wait for a new replica (the caller bounds the wait).
            candidate_replicas = [r for r in candidate_replicas if self.worker_name(r) not in header.avoid_workers]
            by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
            if not candidate_replicas:
                return []
        lookup = await self._lookup(header)
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else ""
        snapshot = self._snapshot(by_id, header, lookup, request_id)
        decision = self.policy.choose(snapshot)
        self.counters.decisions += 1
        cached = snapshot.request.cached_tokens(decision.replica_id)
        if cached:
            self.counters.cache_routed += 1
        self._observe(pending_request, started_ns, decision, by_id, header, lookup, cached)
        self.last_decision = decision
        if pending_request is not None:
            self.inflight.assign(pending_request.metadata.internal_request_id, decision.replica_id,
                                 snapshot.request.uncached_tokens(decision.replica_id)
                                 if self.pool == "prefill" else 0)
        return [[by_id[rid]] for rid in decision.ranked]

    def _observe(self, pending_request, started_ns, decision, by_id, header, lookup, cached) -> None:
        """The ``router.route`` span (child of the request's trace) and the
        decision counter; never raises into routing."""
        from pdcluster.observability import metrics, tracing
        degraded = lookup is not None and lookup.degraded
        try:
            carrier = tracing.carrier_of(pending_request.args) if pending_request else None
            if carrier:
                tracing.record_span("router.route", started_ns, time.time_ns(), carrier, {
                    tracing.POOL: self.pool, tracing.POLICY: self.policy.name,
                    tracing.ROUTE_REASON: decision.reason,
                    tracing.REPLICA: self.worker_name(by_id[decision.replica_id]),
                    tracing.CACHED_TOKENS: cached,
                    tracing.CACHE_HIT_BLOCKS: cached // header.block_size if header else 0,
                    "router.candidates": len(by_id), "router.index_degraded": degraded})
            metrics.count_route(self.pool, self.policy.name, metrics.route_outcome(header is not None, degraded, cached))
        except Exception:  # noqa: BLE001 - observability must not break routing
            log.exception("recording the routing decision failed")

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.inflight.moved(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.inflight.complete(internal_request_id)

    # -- pieces ----------------------------------------------------------------
    async def _lookup(self, header: RoutingHeader | None) -> LookupResult | None:
        if header is None or not header.block_hashes or not self.policy.uses_prefix_index \
                or not (self._index_url or self._index):
            return None
        if self._index is None:  # created on the router's own loop
            self._index = make_index(self._index_url, lookup_timeout_s=self._lookup_timeout_s,
                                     **self._index_options)
        from pdcluster.prefix_store.recent_lookups import RECENT_LOOKUPS  # not a global: the class is pickled
        shared = RECENT_LOOKUPS.take(self._index.shared_scope, header.block_hashes)
        if shared is not None:  # admission asked the same a moment ago, in this process
            self.counters.shared_lookups += 1
            return shared
        self.counters.lookups += 1
        reason = "degraded"
        try:
            result = await self._index.lookup(header.block_hashes)
        except Exception as err:  # the index promises not to raise; never fail a request anyway
            log.exception("prefix index lookup raised; routing by load only")
            reason = "raised"
            result = LookupResult.unavailable(len(header.block_hashes), repr(err))
        if result.degraded:
            self.counters.degraded_lookups += 1
            from pdcluster.observability import metrics
            metrics.count_index_lookup_failure(self.pool, reason)
        return result

    def worker_name(self, replica: RunningReplica) -> str:
        return (ReplicaStats.from_routing_stats(replica.routing_stats).worker_name
                or replica.replica_metadata.get(WORKER_NAME_KEY)
                or replica.replica_id.unique_id)

    def _snapshot(self, by_id: dict[str, RunningReplica], header: RoutingHeader | None,
                  lookup: LookupResult | None, request_id: str = "") -> RoutingSnapshot:
        loads, matched, load_s = [], {}, {}
        for rid, replica in by_id.items():
            stats = ReplicaStats.from_routing_stats(replica.routing_stats)
            tokens, count = self.inflight.load(rid)
            loads.append(ReplicaLoad(
                rid,
                queued_prefill_tokens=max(tokens, stats.queued_prefill_tokens),
                running_requests=max(count, stats.running_requests),
                free_kv_blocks=(stats.free_kv_blocks if stats.free_kv_blocks is not None
                                else self.default_free_kv_blocks),
                prefill_tokens_per_s=stats.prefill_tokens_per_s or self.default_prefill_tokens_per_s,
                pull_s_per_block=stats.pull_s_per_block, pull_overhead_s=stats.pull_overhead_s))
            if lookup is not None and header is not None:
                name = self.worker_name(replica)
                blocks = lookup.matched_blocks.get(name, 0)
                if blocks:
                    matched[rid] = blocks * header.block_size
                if name in lookup.tier_blocks:
                    load_s[rid] = tier_load_s(lookup.tier_blocks[name], self.block_load_s)
        # No prefix to keep together: spread ties by request instead of piling on one replica.
        affinity_key = header.affinity_key if header is not None and header.block_hashes \
            else zlib.crc32(request_id.encode())
        request = (RequestShape(0, affinity_key=affinity_key) if header is None else RequestShape(
            header.num_prompt_tokens, matched, num_output_tokens=header.max_new_tokens,
            block_size=header.block_size, affinity_key=affinity_key, tier_load_s=load_s,
            peer_pull_s_per_block=self.peer_pull_s_per_block))
        return RoutingSnapshot(tuple(loads), request)


class PrefillRequestRouter(PrefixAwareRequestRouter):
    """``PrefixAwareRequestRouter`` with pool="prefill" (cache_aware by default)."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**{"pool": "prefill", **kwargs})


class DecodeRequestRouter(PrefixAwareRequestRouter):
    """``PrefixAwareRequestRouter`` with pool="decode" (decode_by_kv by default)."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**{"pool": "decode", **kwargs})


def request_router_config(pool: str, *, index_url: str | None = None, stats_period_s: float = 1.0,
                          **router_kwargs: Any) -> RequestRouterConfig:
    """The ``RequestRouterConfig`` for one pool's deployment."""
    cls = {"prefill": PrefillRequestRouter, "decode": DecodeRequestRouter}.get(pool)
    if cls is None:
        raise ValueError(f"router pool {pool!r} is unknown: use 'prefill' or 'decode'")
    return RequestRouterConfig(request_router_class=cls,
                               request_router_kwargs={"index_url": index_url, **router_kwargs},
                               request_routing_stats_period_s=stats_period_s)
