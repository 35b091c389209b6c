"""least_loaded: power of two choices on queued work; ignores the cache.

Rule: sample two distinct replicas uniformly (seeded RNG, injectable); pick
the one with the smaller ``(queued prefill tokens / prefill rate,
running requests)``; on a full tie keep the first sampled.  With one
replica, pick it.  The rest of the ranking is by the same key.
"""

from __future__ import annotations

import random

from pdcluster.router.policy_base import RoutingPolicy
from pdcluster.router.snapshot import ReplicaLoad, RoutingDecision, RoutingSnapshot, estimated_ttft_s


def _load_key(replica: ReplicaLoad) -> tuple[float, int]:
    return (replica.drain_s, replica.running_requests)


def least_loaded(snapshot: RoutingSnapshot, rng: random.Random) -> RoutingDecision:
    replicas = snapshot.replicas
    sampled = rng.sample(range(len(replicas)), k=min(2, len(replicas)))
    first, *second = (replicas[i] for i in sampled)
    chosen = first
    if second and _load_key(second[0]) < _load_key(first):
        chosen = second[0]
    others = sorted((r for r in replicas if r is not chosen), key=_load_key)
    ranked = (chosen.replica_id, *(r.replica_id for r in others))
    reason = (f"power of two: {chosen.replica_id} drains in {chosen.drain_s:.3f}s"
              + (f" vs {second[0].replica_id if chosen is first else first.replica_id}" if second else ""))
    return RoutingDecision(chosen.replica_id, reason, estimated_ttft_s(chosen, snapshot.request), ranked)


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    def __init__(self, seed: int | None = 0, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random(seed)

    def choose(self, snapshot: RoutingSnapshot) -> RoutingDecision:
        return least_loaded(snapshot, self._rng)
