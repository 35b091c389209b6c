"""The global prefix index: which live worker holds how many leading blocks.

Contract every implementation keeps (tests/integration/prefix_store runs one
behavioural suite against all of them):

* ``publish`` applies a worker's coalesced stored/evicted batch.
* ``register``/``heartbeat`` keep a worker live for ``ttl_s``; a worker whose
  heartbeat lapses stops matching within its TTL; registering a *newer* epoch
  of the same name retires the old one at once (its entries never count
  again); a heartbeat from an *older* epoch is refused (``SUPERSEDED``).
* ``lookup(block_hashes)`` returns, for every live worker holding block 0,
  how many *leading* blocks it holds, in any tier (device pool, host memory
  or disk: events.py), and of those how many sit only in a lower tier
  (``tier_blocks``: they cost a load, not a recompute).  It never raises: when the backing
  store is down or slow it returns an empty, ``degraded`` result within its
  timeout, so the router falls back to load-only routing.
* Write operations raise ``IndexUnavailable`` so the publisher can buffer
  and re-sync; nothing else escapes.

Each implementation imports this module; the table of implementations by URL
scheme is pdcluster.prefix_store.index, which imports them (nothing imports it back).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdcluster.prefix_store.events import DEVICE, EventBatch
from pdcluster.prefix_store.worker_id import WorkerId


def tier_member(worker_key: str, tier: str) -> str:
    """The index member that says ``worker_key`` holds a block in ``tier``:
    the key itself for the device pool, ``key#tier`` for a lower tier."""
    return worker_key if tier == DEVICE else f"{worker_key}#{tier}"


def split_member(member: str) -> tuple[str, str]:
    """(worker key, tier) of an index member (the inverse of ``tier_member``)."""
    cut = member.find("#", member.find("@"))
    return (member, DEVICE) if cut < 0 else (member[:cut], member[cut + 1:])


class IndexUnavailable(RuntimeError):
    """The index could not apply a write; the caller should buffer and retry."""


class HeartbeatStatus(enum.Enum):
    REGISTERED = "registered"    # was not live (new, expired, or index restarted): republish
    RENEWED = "renewed"          # was live at this epoch
    TOOK_OVER = "took_over"      # replaced an older epoch of the same name
    SUPERSEDED = "superseded"    # a newer epoch of this name is live: stop publishing


@dataclass(frozen=True)
class LookupResult:
    """Leading-match length in blocks per live worker name (only names with >= 1)."""

    matched_blocks: dict[str, int]
    num_blocks: int
    degraded: bool = False       # True: the index could not answer; treat as no matches
    error: str = ""
    # worker name -> {"host": n, "disk": m}: leading blocks it holds only in a lower tier (none: absent)
    tier_blocks: dict[str, dict[str, int]] = field(default_factory=dict)

    def device_blocks(self, name: str) -> int:
        """Leading blocks ``name`` holds in its device pool or could load from a tier, less the tier ones."""
        return self.matched_blocks.get(name, 0) - sum(self.tier_blocks.get(name, {}).values())

    @classmethod
    def unavailable(cls, num_blocks: int, error: str) -> "LookupResult":
        return cls({}, num_blocks, degraded=True, error=error)

    def best(self) -> tuple[str, int] | None:
        if not self.matched_blocks:
            return None
        name = max(self.matched_blocks, key=lambda n: (self.matched_blocks[n], n))
        return name, self.matched_blocks[name]


@dataclass
class IndexCounters:
    lookups: int = 0
    lookup_failures: int = 0      # errors and timeouts
    lookups_skipped: int = 0      # answered "no matches" without trying (store marked down)
    publishes: int = 0
    publish_failures: int = 0
    purged_blocks: int = 0
    last_error: str = ""


@dataclass
class PurgeReport:
    workers_purged: list[str] = field(default_factory=list)
    blocks_removed: int = 0


class PrefixIndex(ABC):
    """Async interface; the serving path awaits it on its event loop."""

    counters: IndexCounters

    @property
    def shared_scope(self) -> str | None:
        """The store and namespace this index reads, where another index object in this process may
        read the same (its lookups may then be shared: recent_lookups.py); None: none can."""
        return None

    @abstractmethod
    async def register(self, worker: WorkerId, ttl_s: float, info: dict | None = None) -> HeartbeatStatus:
        """Make ``worker`` live for ``ttl_s`` (same rules as ``heartbeat``)."""

    @abstractmethod
    async def heartbeat(self, worker: WorkerId, ttl_s: float) -> HeartbeatStatus: ...

    @abstractmethod
    async def deregister(self, worker: WorkerId) -> None:
        """Stop matching ``worker`` now and delete its entries."""

    @abstractmethod
    async def publish(self, worker: WorkerId, batch: EventBatch) -> None: ...

    @abstractmethod
    async def clear_worker(self, worker: WorkerId) -> int:
        """Delete every entry of ``worker`` (live or not); returns blocks removed.
        A worker calls it on itself before republishing its full block set."""

    @abstractmethod
    async def lookup(self, block_hashes: Sequence[int]) -> LookupResult: ...

    @abstractmethod
    async def live_workers(self) -> list[WorkerId]:
        """Workers live at their current epoch, sorted (for operators and tests)."""

    @abstractmethod
    async def purge_dead_workers(self) -> PurgeReport:
        """Delete the entries of every worker that is no longer live at its epoch."""

    async def close(self) -> None:
        return None
