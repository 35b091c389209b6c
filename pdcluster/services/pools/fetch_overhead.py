"""What asking a peer for a prefix costs beyond moving its blocks, from
this replica's own fetches: the lease call to the holder (answered between
the holder's engine steps), reserving and landing the blocks, the request
held back meanwhile.  The peer-fetch rule's ``pull_overhead_s``
(pdcluster/router/peer_fetch.py) was a constant 20 ms; measured on a 2-core
Sapphire Rapids (two 1-thread colocated replicas, chat turns) a fetch cost
more than recomputing its blocks there, and the turns' TTFT p50 rose from
0.17 s to 0.26 s with peer fetch on.

    overhead_s = median over this replica's fetches of the last WINDOW_S of
                 (fetch seconds - its transfer's seconds)        a failed fetch: all of its seconds
                 (the default when there is none)

Forgetting after WINDOW_S is what lets a replica try again: once fetches
cost more than recomputing, the rule stops fetching and no sample comes;
a minute later the default holds again and the next fetch measures anew."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable

WINDOW_S = 60.0
MAX_SAMPLES = 32


def overhead_s(samples: Iterable[tuple[float, float]], now: float, default_s: float,
               window_s: float = WINDOW_S) -> float:
    """The median overhead of the (when, seconds) samples newer than ``window_s`` (pure)."""
    recent = [s for at, s in samples if now - at <= window_s and s >= 0]
    return statistics.median(recent) if recent else default_s


class FetchOverhead:
    def __init__(self, default_s: float, clock: Callable[[], float] = time.monotonic):
        self.default_s, self._clock = default_s, clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def observe(self, seconds: float) -> None:
        if seconds >= 0:
            self._samples.append((self._clock(), seconds))

    def seconds(self) -> float:
        return overhead_s(self._samples, self._clock(), self.default_s)
