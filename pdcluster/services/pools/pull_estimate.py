"""How long one KV block takes to pull here, from this replica's own pulls
(prefill hand-offs and peer prefix fetches alike: the same transfer layer,
the same block size).

A pull costs a fixed part (a round trip or two, NIXL's notification, the
checksum check's start) and a part per block.  A two-block hand-off's
seconds divided by its blocks measures mostly the fixed part, so the
per-block figure comes from pulls big enough that the fixed part is a
small share of them:

    per_block_s = median over the last WINDOW pulls of >= MIN_BLOCKS blocks of (seconds / blocks)
                  (the default when there is none yet)

The fixed part is the peer-fetch rule's ``pull_overhead_s``
(pdcluster/router/peer_fetch.py); this is its per-block part only.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable

MIN_BLOCKS = 8   # a 128-token prompt's hand-off: the fixed part (a few ms) is a small share of it
WINDOW = 32      # recent enough to follow a change of transport, long enough that one slow pull is outvoted


def per_block_s(samples: Iterable[tuple[int, float]], default_s: float, min_blocks: int = MIN_BLOCKS) -> float:
    """The median of seconds per block over the (blocks, seconds) samples of at least ``min_blocks`` blocks."""
    rates = [seconds / blocks for blocks, seconds in samples if blocks >= min_blocks and seconds >= 0]
    return statistics.median(rates) if rates else default_s


class PullEstimate:
    """The recent pulls and the per-block time they give."""

    def __init__(self, default_s: float, window: int = WINDOW):
        self.default_s = default_s
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, num_blocks: int, seconds: float) -> None:
        if num_blocks >= MIN_BLOCKS and seconds >= 0:
            self._samples.append((num_blocks, seconds))

    def per_block_s(self) -> float:
        return per_block_s(self._samples, self.default_s)
