"""How long each part of one engine-thread turn took, and a warning when a
turn was slow enough to show as a gap in every stream it serves.

Beside the wall time, the thread's own CPU time: a slow turn whose CPU time
is small waited (for the GIL, or for a core on a busy machine) rather than
worked."""

from __future__ import annotations

import logging
import time

SLOW_TURN_S = 0.25   # a gap a client sees: half the isolation tests' bound


class TurnClock:
    def __init__(self) -> None:
        self.started = self._last = time.perf_counter()
        self.cpu_started = time.thread_time()
        self.parts: list[tuple[str, float]] = []

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.parts.append((part, now - self._last))
        self._last = now

    @property
    def wall_s(self) -> float:
        return self._last - self.started

    def log_if_slow(self, log: logging.Logger, turn: int) -> bool:
        if self.wall_s < SLOW_TURN_S:
            return False
        cpu = time.thread_time() - self.cpu_started
        log.warning("slow engine turn (turn %d): %.3f s wall, %.3f s of this thread's CPU (%s)", turn, self.wall_s,
                    cpu, ", ".join(f"{name} {s:.3f} s" for name, s in self.parts))
        return True
