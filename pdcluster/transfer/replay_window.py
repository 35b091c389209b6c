"""Which write requests an owner has already seen, per puller agent: a
replayed request (same puller incarnation, same seq) is refused.

    seq:   ... [ highest - WINDOW ......... highest ]  new ->
           too old    seen ones remembered here       accepted, window slides

Requests of one puller may arrive slightly out of order (several threads
pull at once), so a seq below the highest is accepted once if it is inside
the window.  At most ``max_pullers`` agents are remembered (least recently
seen dropped): a dropped puller's old requests would pass this check again,
and their ttl counts from their new receipt (write_request: ``ttl``), so
only the tag (bound to both incarnations) and, on a guarded owner (the
serving layer's), the lease released or ended by then refuse them."""

from __future__ import annotations

from collections import OrderedDict

WINDOW = 1024
MAX_PULLERS = 4096


class ReplayWindow:
    def __init__(self, window: int = WINDOW, max_pullers: int = MAX_PULLERS) -> None:
        if window <= 0 or max_pullers <= 0:
            raise ValueError(f"window and max_pullers must be > 0, got {window}, {max_pullers}")
        self.window = window
        self.max_pullers = max_pullers
        self._seen: OrderedDict[str, tuple[int, set[int]]] = OrderedDict()  # agent -> (highest, seqs in window)

    def accept(self, agent: str, seq: int) -> bool:
        """True the first time ``seq`` of ``agent`` is seen inside the window; False for a replay or a stale seq."""
        highest, seen = self._seen.pop(agent, (0, set()))
        if seq in seen or seq <= highest - self.window:
            self._seen[agent] = (highest, seen)
            return False
        seen.add(seq)
        if seq > highest:
            highest = seq
            seen = {s for s in seen if s > highest - self.window}
        self._seen[agent] = (highest, seen)
        while len(self._seen) > self.max_pullers:
            self._seen.popitem(last=False)
        return True
