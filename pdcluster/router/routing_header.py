"""The routing facts the gateway attaches to every prefill/decode call.

The gateway already tokenizes and hashes the prompt (pdcluster.prefix_store.hashing),
so it passes the hashes along; the router never sees prompt text.  Every
call's message (pdcluster/services/messages.py: GenerateRequest, LeaseRelease) carries
one ``RoutingHeader`` as its ``routing`` field, and the router reads it by
type from the call's first argument (``routing_header_of``); a call whose
first argument carries none is routed by load only.

``target_worker`` pins a call to one replica (releasing a lease that replica
holds); ``prefer_worker`` sends it to one replica while that replica is live
(choices 1.. of ``n`` > 1 go where choice 0 cached the prompt) and routes it
as usual once it is gone; ``avoid_workers`` keeps a failover off the replicas
its stream lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RoutingHeader:
    block_hashes: tuple[int, ...]
    num_prompt_tokens: int
    block_size: int = 16
    max_new_tokens: int = 0
    target_worker: str | None = None  # only this replica (by worker name): a call about state it holds
    avoid_workers: tuple[str, ...] = ()  # never these replicas (by worker name): a failover's lost ones
    prefer_worker: str | None = None  # this replica while it is live, else routed as usual: state it may hold

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hashes", tuple(int(h) for h in self.block_hashes))
        object.__setattr__(self, "avoid_workers", tuple(str(w) for w in self.avoid_workers))
        if self.block_size < 1 or self.num_prompt_tokens < 0 or self.max_new_tokens < 0:
            raise ValueError(f"bad routing header {self}: block_size >= 1 and token counts >= 0")
        if len(self.block_hashes) * self.block_size > self.num_prompt_tokens:
            raise ValueError(
                f"routing header has {len(self.block_hashes)} full blocks of {self.block_size} but "
                f"only {self.num_prompt_tokens} prompt tokens: hash full blocks only")

    @property
    def affinity_key(self) -> int:
        return self.block_hashes[0] if self.block_hashes else 0


def routing_header_of(args: Sequence[Any]) -> RoutingHeader | None:
    """The header of a call's message (its first argument's ``routing``), or None."""
    header = getattr(args[0], "routing", None) if args else None
    return header if isinstance(header, RoutingHeader) else None
