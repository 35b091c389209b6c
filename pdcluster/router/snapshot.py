"""What a routing decision sees, and what it returns.

A policy is a pure function ``RoutingSnapshot -> RoutingDecision``: the Serve
router (or the simulator in bench/load/routing.py) gathers loads and prefix matches
first, then asks the policy.  Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdcluster.router.peer_fetch import DEFAULT_PULL_OVERHEAD_S, pull_s, should_pull


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    queued_prefill_tokens: int = 0      # prompt tokens waiting for or in prefill
    running_requests: int = 0           # requests in flight on this replica
    free_kv_blocks: int = 0
    prefill_tokens_per_s: float = 1.0   # measured prefill throughput
    # What a pull from a peer costs this replica, as it measured its own (None: the request's
    # peer_pull_s_per_block and the rule's default overhead; pdcluster/router/peer_fetch.py)
    pull_s_per_block: float | None = None
    pull_overhead_s: float | None = None

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"replica {self.replica_id}: prefill_tokens_per_s must be > 0, "
                             f"got {self.prefill_tokens_per_s}; report a measured rate or a default")

    @property
    def drain_s(self) -> float:
        """Seconds until the queued prefill work is done."""
        return self.queued_prefill_tokens / self.prefill_tokens_per_s


@dataclass(frozen=True)
class RequestShape:
    num_prompt_tokens: int
    matched_tokens: Mapping[str, int] = field(default_factory=dict)  # replica id -> cached prefix
    num_output_tokens: int = 0          # decode: tokens it may still generate
    block_size: int = 16
    affinity_key: int = 0               # e.g. first block hash: stable tie-break per prefix
    # replica id -> seconds to load the part of its cached prefix that sits in a
    # host or disk tier (pdcluster/services/engine/kv_tiers.py): cached, but not free
    tier_load_s: Mapping[str, float] = field(default_factory=dict)
    # Peer prefix fetch (pdcluster/router/peer_fetch.py) on: seconds to pull one block from the
    # replica that caches it; None: off (a replica computes what it lacks)
    peer_pull_s_per_block: float | None = None

    def cached_tokens(self, replica_id: str) -> int:
        return max(0, min(self.matched_tokens.get(replica_id, 0), self.num_prompt_tokens))

    def uncached_tokens(self, replica_id: str) -> int:
        return self.num_prompt_tokens - self.cached_tokens(replica_id)


@dataclass(frozen=True)
class RoutingSnapshot:
    replicas: tuple[ReplicaLoad, ...]
    request: RequestShape

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("routing snapshot has no replicas: wait for the pool to come up")


@dataclass(frozen=True)
class RoutingDecision:
    replica_id: str
    reason: str
    estimated_ttft_s: float | None
    ranked: tuple[str, ...]             # full preference order, chosen first


def estimated_ttft_s(replica: ReplicaLoad, request: RequestShape) -> float:
    """(queued prefill tokens + tokens it computes) / prefill rate, plus the
    time to load the cached blocks that sit in a host or disk tier, plus the
    time to pull what a peer caches past its own when that beats computing it."""
    pulled_blocks, pull_s = peer_pull(replica, request)
    computed = request.uncached_tokens(replica.replica_id) - pulled_blocks * request.block_size
    return (replica.queued_prefill_tokens + computed) / replica.prefill_tokens_per_s \
        + request.tier_load_s.get(replica.replica_id, 0.0) + pull_s


def peer_pull(replica: ReplicaLoad, request: RequestShape) -> tuple[int, float]:
    """(blocks, seconds): what ``replica`` would pull from the replica caching the
    most of the prompt, past its own cached blocks and short of the last token's
    (pdcluster/router/peer_fetch.py's rule, priced with the replica's own measured pull cost where it
    reports one: the same figures its fetcher decides with); (0, 0.0) when peer fetch is off or computing
    them is cheaper."""
    if request.peer_pull_s_per_block is None or not request.matched_tokens:
        return 0, 0.0
    usable = max(request.num_prompt_tokens - 1, 0)
    best = min(max(request.matched_tokens.values()), usable)
    blocks = (best - min(request.cached_tokens(replica.replica_id), usable)) // request.block_size
    per_token_s = 1.0 / replica.prefill_tokens_per_s
    per_block_s = replica.pull_s_per_block if replica.pull_s_per_block is not None else request.peer_pull_s_per_block
    overhead_s = replica.pull_overhead_s if replica.pull_overhead_s is not None else DEFAULT_PULL_OVERHEAD_S
    if not should_pull(blocks, request.block_size, per_block_s, per_token_s, overhead_s):
        return 0, 0.0
    return blocks, pull_s(blocks, per_block_s, overhead_s)


# Seconds to bring one block back from a lower tier, when the router is not told
# better: a host block is one memory copy, a disk block a read of the same bytes
# (bench/load/prefix_tiers.py measures both beside the prefill time they save).
DEFAULT_BLOCK_LOAD_S = {"host": 0.0002, "disk": 0.002}


def tier_load_s(tier_blocks: Mapping[str, int], block_load_s: Mapping[str, float] = DEFAULT_BLOCK_LOAD_S) -> float:
    """Seconds to load ``{"host": n, "disk": m}`` blocks back into a device pool."""
    return sum(n * block_load_s.get(tier, DEFAULT_BLOCK_LOAD_S.get(tier, 0.0)) for tier, n in tier_blocks.items())


def affinity_rank(affinity_key: int, replica_id: str) -> int:
    """Rendezvous-hash rank: a stable, spread-out tie-break per prefix, so equal
    candidates send one prefix to one replica (even with no index) and
    different prefixes to different replicas."""
    digest = hashlib.blake2b(f"{affinity_key}:{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)
