"""decode_by_kv: pick a decode replica by free KV blocks and running batch size.

Rule:

    needed = ceil((prompt_tokens + output_tokens) / block_size)
    fits(i) <=> free_kv_blocks(i) >= needed

    if any replica fits:  argmin over fitting i of (running_requests(i), -free_kv_blocks(i),
                                                     affinity_rank(prefix, i))
    else:                 argmax free_kv_blocks(i)  (it will queue there; the reason says so)

Smaller batches decode each token sooner; among equal batches, more free
blocks means less preemption risk.  No TTFT estimate: the first token comes
from prefill.
"""

from __future__ import annotations

from pdcluster.router.policy_base import RoutingPolicy
from pdcluster.router.snapshot import ReplicaLoad, RoutingDecision, RoutingSnapshot, affinity_rank, blocks_needed


def decode_by_kv(snapshot: RoutingSnapshot) -> RoutingDecision:
    req = snapshot.request
    needed = blocks_needed(req.num_prompt_tokens + req.num_output_tokens, req.block_size)

    def key(r: ReplicaLoad) -> tuple[int, int, int]:
        return (r.running_requests, -r.free_kv_blocks, affinity_rank(req.affinity_key, r.replica_id))

    fitting = sorted((r for r in snapshot.replicas if r.free_kv_blocks >= needed), key=key)
    short = sorted((r for r in snapshot.replicas if r.free_kv_blocks < needed),
                   key=lambda r: (-r.free_kv_blocks, key(r)))
    if fitting:
        chosen = fitting[0]
        reason = (f"fits {needed} blocks ({chosen.free_kv_blocks} free), "
                  f"batch {chosen.running_requests}")
    else:
        chosen = short[0]
        reason = (f"no decode replica has {needed} free blocks; queueing on the one with the most "
                  f"({chosen.free_kv_blocks}) -- add decode replicas or KV memory")
    ranked = tuple(r.replica_id for r in (*fitting, *short))
    return RoutingDecision(chosen.replica_id, reason, None, ranked)


class DecodeByKVPolicy(RoutingPolicy):
    name = "decode_by_kv"

    def choose(self, snapshot: RoutingSnapshot) -> RoutingDecision:
        return decode_by_kv(snapshot)
