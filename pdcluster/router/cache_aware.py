"""cache_aware: lowest estimated time to first token, inside an imbalance guard.

The whole rule:

    drain_s(i) = queued_prefill_tokens(i) / prefill_tokens_per_s(i)
    ttft_s(i)  = (queued_prefill_tokens(i) + prompt_tokens - cached_tokens(i) - pulled_tokens(i))
                 / prefill_tokens_per_s(i)  +  tier_load_s(i)  +  pull_s(i)
    cost_s(i)  = ttft_s(i) + recompute_weight * (max_j cached_tokens(j) - cached_tokens(i) - pulled_tokens(i))
                                              / prefill_tokens_per_s(i)

    IMBALANCE GUARD:  eligible(i)  <=>  drain_s(i) <= min_j drain_s(j) + max_extra_queue_s

    choose  argmin over eligible i of
            (cost_s(i), -cached_tokens(i), running_requests(i), affinity_rank(prefix, i))

* ``ttft_s`` is the queue and the uncached prompt at the measured prefill rate.  ``cached_tokens`` counts blocks in
  every tier of the replica (device pool, host memory, disk); those in a
  lower tier add their load time (``tier_load_s``), not a recompute.  ``cost_s`` adds a charge for
  recomputing tokens another replica already caches: that work delays every
  request queued behind it and pushes other prefixes out of the cache, which
  the per-request TTFT does not see.  With peer prefix fetch on
  (``peer_pull_s_per_block`` set), the blocks another replica caches past
  i's own are pulled rather than recomputed when that is predicted cheaper
  (pdcluster/router/peer_fetch.py): ``pulled_tokens(i)`` of them cost ``pull_s(i)``
  and no recompute charge.  ``pull_s(i)`` uses i's own measured pull cost (seconds per
  block and a fetch's fixed part, from its routing stats), the figures its fetcher
  decides with, so the router does not send a prefix to a replica that will then
  find the pull too dear and recompute it.  ``recompute_weight = 0`` is the plain
  TTFT rule; bench/load/routing.py measured it losing 10-40% of the hit rate above
  1x load, and weight 1 collapsing (spill cascade) at 2x; 2 (default) held.
* IMBALANCE GUARD: a cache hit may buy at most ``max_extra_queue_s``
  (default 0.5 s) of extra queueing over the least-loaded replica.  Past
  that the cached replica is not eligible, however good its cost: estimates
  go stale between routers, and a hot prefix must not pile onto one replica
  (spilling it is also how a hot prefix gets replicated).  The least-loaded
  replica is always eligible, so there is always a choice.
* Ties (all idle, nothing cached) go to the replica with fewer requests in
  flight, then to the one the prefix's rendezvous hash ranks first: a new
  prefix lands on a stable, spread-out replica, and its next request finds
  the cache there even if the index is down.
* The ranking after the choice is the eligible replicas by the same key,
  then the guarded-out ones by drain time; Serve falls through it when a
  replica is full.
"""

from __future__ import annotations

from pdcluster.router.policy_base import RoutingPolicy
from pdcluster.router.snapshot import (
    ReplicaLoad, RoutingDecision, RoutingSnapshot, affinity_rank, estimated_ttft_s, peer_pull,
)

DEFAULT_MAX_EXTRA_QUEUE_S = 0.5
DEFAULT_RECOMPUTE_WEIGHT = 2.0


def cache_aware(snapshot: RoutingSnapshot, max_extra_queue_s: float = DEFAULT_MAX_EXTRA_QUEUE_S,
                recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT) -> RoutingDecision:
    req = snapshot.request
    min_drain_s = min(r.drain_s for r in snapshot.replicas)
    limit_s = min_drain_s + max_extra_queue_s
    best_cached = max(req.cached_tokens(r.replica_id) for r in snapshot.replicas)

    def key(r: ReplicaLoad) -> tuple[float, int, int, int]:
        cached = req.cached_tokens(r.replica_id)
        missing = best_cached - cached - peer_pull(r, req)[0] * req.block_size
        cost_s = estimated_ttft_s(r, req) + recompute_weight * max(missing, 0) / r.prefill_tokens_per_s
        return (cost_s, -cached, r.running_requests, affinity_rank(req.affinity_key, r.replica_id))

    eligible = sorted((r for r in snapshot.replicas if r.drain_s <= limit_s), key=key)
    guarded = sorted((r for r in snapshot.replicas if r.drain_s > limit_s), key=lambda r: (r.drain_s, key(r)))
    chosen = eligible[0]
    cached = req.cached_tokens(chosen.replica_id)
    if best_cached > cached and any(req.cached_tokens(r.replica_id) == best_cached for r in guarded):
        holder = next(r for r in guarded if req.cached_tokens(r.replica_id) == best_cached)
        reason = (f"imbalance guard: {holder.replica_id} caches {best_cached} tokens but drains in "
                  f"{holder.drain_s:.3f}s > {min_drain_s:.3f}s + {max_extra_queue_s}s")
    elif cached:
        reason = f"cache hit {cached}/{req.num_prompt_tokens} tokens"
    else:
        reason = "no usable cached prefix; lowest estimated TTFT"
    ttft_s = estimated_ttft_s(chosen, req)
    ranked = tuple(r.replica_id for r in (*eligible, *guarded))
    return RoutingDecision(chosen.replica_id, f"{reason}; est ttft {ttft_s:.3f}s", ttft_s, ranked)


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"
    uses_prefix_index = True

    def __init__(self, max_extra_queue_s: float = DEFAULT_MAX_EXTRA_QUEUE_S,
                 recompute_weight: float = DEFAULT_RECOMPUTE_WEIGHT) -> None:
        if max_extra_queue_s < 0 or recompute_weight < 0:
            raise ValueError(f"max_extra_queue_s ({max_extra_queue_s}) and recompute_weight "
                             f"({recompute_weight}) must be >= 0")
        self.max_extra_queue_s = max_extra_queue_s
        self.recompute_weight = recompute_weight

    def choose(self, snapshot: RoutingSnapshot) -> RoutingDecision:
        return cache_aware(snapshot, self.max_extra_queue_s, self.recompute_weight)
