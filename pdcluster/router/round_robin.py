"""round_robin: replica ``turn mod n`` in snapshot order; ignores load and cache.

The baseline every other policy is measured against.
"""

from __future__ import annotations

from pdcluster.router.policy_base import RoutingPolicy
from pdcluster.router.snapshot import RoutingDecision, RoutingSnapshot, estimated_ttft_s


def round_robin(snapshot: RoutingSnapshot, turn: int) -> RoutingDecision:
    replicas = snapshot.replicas
    start = turn % len(replicas)
    ranked = tuple(replicas[(start + k) % len(replicas)].replica_id for k in range(len(replicas)))
    chosen = replicas[start]
    return RoutingDecision(chosen.replica_id, f"round robin turn {turn}",
                           estimated_ttft_s(chosen, snapshot.request), ranked)


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, snapshot: RoutingSnapshot) -> RoutingDecision:
        decision = round_robin(snapshot, self._turn)
        self._turn += 1
        return decision
