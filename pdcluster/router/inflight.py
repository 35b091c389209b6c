"""In-flight load this router has sent to each replica.

Serve's ``routing_stats`` arrive seconds late, far too slow for queue
lengths, so the router counts what it routed itself: a request is added when
the policy picks a replica (moved if Serve ends up elsewhere) and removed on
completion.  Entries older than ``ttl_s`` are dropped, so a request whose
completion was never reported cannot inflate a replica's load forever.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Entry:
    replica_id: str
    prefill_tokens: int
    since_s: float


class InFlightTracker:
    def __init__(self, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._tokens: dict[str, int] = {}
        self._count: dict[str, int] = {}
        self._next_sweep_s = 0.0

    def _add(self, request_id: str, entry: _Entry) -> None:
        self._entries[request_id] = entry
        self._tokens[entry.replica_id] = self._tokens.get(entry.replica_id, 0) + entry.prefill_tokens
        self._count[entry.replica_id] = self._count.get(entry.replica_id, 0) + 1

    def _remove(self, request_id: str) -> _Entry | None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._tokens[entry.replica_id] -= entry.prefill_tokens
            self._count[entry.replica_id] -= 1
        return entry

    def assign(self, request_id: str, replica_id: str, prefill_tokens: int) -> None:
        """Record (or re-record, on a routing retry) where a request is going."""
        self._remove(request_id)
        self._add(request_id, _Entry(replica_id, prefill_tokens, self._clock()))

    def moved(self, request_id: str, replica_id: str) -> None:
        """Serve sent it to ``replica_id`` (maybe not the policy's first choice)."""
        entry = self._remove(request_id)
        if entry is not None:
            self._add(request_id, _Entry(replica_id, entry.prefill_tokens, entry.since_s))

    def complete(self, request_id: str) -> None:
        self._remove(request_id)

    def load(self, replica_id: str) -> tuple[int, int]:
        """(queued prefill tokens, requests in flight) on ``replica_id``."""
        self.sweep()
        return self._tokens.get(replica_id, 0), self._count.get(replica_id, 0)

    def sweep(self) -> None:
        now = self._clock()
        if now < self._next_sweep_s:
            return
        self._next_sweep_s = now + min(1.0, self.ttl_s / 10)
        cutoff = now - self.ttl_s
        for request_id in [r for r, e in self._entries.items() if e.since_s < cutoff]:
            self._remove(request_id)

    def __len__(self) -> int:
        return len(self._entries)
