"""A prefix-index answer this process got a moment ago, for the router that places the same request.

Admission asks the index how much of a prompt each replica holds
(services/gateway/cached_prefix.py), and the cache-aware request router that
places the request milliseconds later, in the same gateway process
(router/serve_router.py), asked the same question again: two Redis round
trips per request, each bounded by ``router.lookup_timeout_s``.  Admission
now leaves its answer here and the router takes it, once, while it is
FRESH_S old or younger; an older answer (a request that waited for a seat),
a degraded one, or none is asked of the index again.  The index is itself a
view that KV events reach some milliseconds after the blocks change, so an
answer this young is as current as a new one would be.

Keyed by the index's ``shared_scope`` (store and namespace) and the prompt's
block hashes: only the same question about the same index is answered."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pdcluster.prefix_store.index_base import LookupResult

FRESH_S = 0.25
CAPACITY = 256  # answers kept at most (the oldest dropped): requests admitted and not yet routed


class RecentLookups:
    """Thread-safe: admission and Serve's router may run on different event loops of the process."""

    def __init__(self, fresh_s: float = FRESH_S, capacity: int = CAPACITY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fresh_s, self.capacity, self._clock = fresh_s, capacity, clock
        self._lock = threading.Lock()
        self._answers: OrderedDict[tuple[str, tuple[int, ...]], tuple[float, LookupResult]] = OrderedDict()
        self.num_taken = 0

    def put(self, scope: str | None, block_hashes: Sequence[int], result: LookupResult) -> None:
        if scope is None or result.degraded or not block_hashes:
            return
        with self._lock:
            key = (scope, tuple(block_hashes))
            self._answers.pop(key, None)
            self._answers[key] = (self._clock(), result)
            while len(self._answers) > self.capacity:
                self._answers.popitem(last=False)

    def take(self, scope: str | None, block_hashes: Sequence[int]) -> LookupResult | None:
        """The answer left for this question if it is fresh (and then not again), else None."""
        if scope is None or not block_hashes:
            return None
        with self._lock:
            entry = self._answers.pop((scope, tuple(block_hashes)), None)
            if entry is None or self._clock() - entry[0] > self.fresh_s:
                return None
            self.num_taken += 1
            return entry[1]

    def __len__(self) -> int:
        return len(self._answers)


RECENT_LOOKUPS = RecentLookups()  # this process's
