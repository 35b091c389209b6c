"""The routing facts the gateway attaches to every prefill/decode call.

The gateway already tokenizes and hashes the prompt (prefix_store.hashing),
so it passes the hashes along; the router never sees prompt text.  The
router finds the header, in this order:

    1. keyword argument ``routing=``           handle.remote(req, routing=header)
    2. the first positional argument itself    handle.remote(header)
    3. its ``.routing`` attribute or key        handle.remote(req)  with req.routing = header

A header may be a ``RoutingHeader`` or a plain dict with the same keys
(``block_hashes`` required; ``num_prompt_tokens``, ``block_size``,
``max_new_tokens``, ``target_worker``, ``avoid_workers``, ``prefer_worker`` optional).
``target_worker`` pins a call to one replica (releasing a lease that replica
holds); ``prefer_worker`` sends it to one replica while that replica is live
(choices 1.. of ``n`` > 1 go where choice 0 cached the prompt) and routes it
as usual once it is gone; ``avoid_workers`` keeps a failover off the replicas
its stream lost.  A call without one is routed by load only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

ROUTING_KWARG = "routing"


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"block_hashes": list(self.block_hashes), "avoid_workers": list(self.avoid_workers)}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "RoutingHeader":
        hashes = data["block_hashes"]
        block_size = int(data.get("block_size", 16))
        target = data.get("target_worker")
        avoid = data.get("avoid_workers") or ()
        prefer = data.get("prefer_worker")
        return cls(tuple(hashes), int(data.get("num_prompt_tokens", len(hashes) * block_size)),
                   block_size, int(data.get("max_new_tokens", 0)), target if isinstance(target, str) else None,
                   tuple(w for w in avoid if isinstance(w, str)) if isinstance(avoid, (list, tuple)) else (),
                   prefer if isinstance(prefer, str) else None)


def _as_header(obj: Any) -> RoutingHeader | None:
    if isinstance(obj, RoutingHeader):
        return obj
    if isinstance(obj, Mapping) and "block_hashes" in obj:
        return RoutingHeader.from_mapping(obj)
    return None


def find_routing_header(args: Sequence[Any], kwargs: Mapping[str, Any]) -> RoutingHeader | None:
    """The request's routing header, or None (then the request routes by load)."""
    if ROUTING_KWARG in kwargs:
        return _as_header(kwargs[ROUTING_KWARG])
    if not args:
        return None
    first = args[0]
    header = _as_header(first)
    if header is not None:
        return header
    if isinstance(first, Mapping):
        return _as_header(first.get(ROUTING_KWARG))
    return _as_header(getattr(first, ROUTING_KWARG, None))
