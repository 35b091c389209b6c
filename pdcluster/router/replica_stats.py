"""What a replica reports for routing, and how the router reads it.

Deployments define ``record_routing_stats(self) -> dict``, returning
``ReplicaStats(...).to_routing_stats()``; Serve polls it every
``request_routing_stats_period_s`` and the router reads
``replica.routing_stats``.  Seconds stale, so only slow-changing facts
belong here (prefill rate, free KV blocks, the index worker name); the
router tracks its own in-flight load.  Missing or malformed fields fall back
to defaults -- a replica that reports nothing is routed by load alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

WORKER_NAME_KEY = "worker_name"   # also read from replica_metadata (record_replica_metadata)


@dataclass(frozen=True)
class ReplicaStats:
    worker_name: str | None = None          # this replica's name in the prefix index
    prefill_tokens_per_s: float | None = None
    free_kv_blocks: int | None = None
    queued_prefill_tokens: int = 0          # as the replica sees it (all routers' requests)
    running_requests: int = 0
    # What a pull costs this replica, measured on its own pulls (peer prefix fetch on):
    # seconds per block (pools/pull_estimate.py) and the fixed part of a fetch (pools/fetch_overhead.py)
    pull_s_per_block: float | None = None
    pull_overhead_s: float | None = None

    def to_routing_stats(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_routing_stats(cls, stats: Mapping[str, Any] | None) -> "ReplicaStats":
        stats = stats or {}

        def num(key: str, kind: type, default: Any) -> Any:
            try:
                value = kind(stats[key])
            except (KeyError, TypeError, ValueError):
                return default
            return value if value >= 0 else default

        name = stats.get(WORKER_NAME_KEY)
        rate = num("prefill_tokens_per_s", float, None)
        return cls(worker_name=str(name) if name else None,
                   prefill_tokens_per_s=rate if rate else None,
                   free_kv_blocks=num("free_kv_blocks", int, None),
                   queued_prefill_tokens=num("queued_prefill_tokens", int, 0),
                   running_requests=num("running_requests", int, 0),
                   pull_s_per_block=num("pull_s_per_block", float, None),
                   pull_overhead_s=num("pull_overhead_s", float, None))
