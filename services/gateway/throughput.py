"""The two rates admission compares to tell overload from a standing queue.

    admitted  prompt tokens admitted per second over the last WINDOW_S (wall time)
    served    prompt tokens answered with a first token per *busy* second, over the
              last SERVED_WINDOW first tokens: a first token at time t after a busy
              reference r (the previous first token, or the moment the cluster last
              went from no prompt waiting to some) contributes (tokens, t - r)

Busy time, not wall time, is the served rate's denominator, so an idle spell
does not make the cluster look slow; under saturation it is the cluster's
prefill throughput, whatever the batch sizes.  A closed-loop client (a
fixed concurrency) admits exactly what is served; open-loop arrivals above
capacity admit more."""

from __future__ import annotations

from collections import deque

WINDOW_S = 10.0
SERVED_WINDOW = 32
MIN_SERVED = 4


class AdmittedRate:
    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._tokens = 0

    def add(self, tokens: int, now: float) -> None:
        self._events.append((now, tokens))
        self._tokens += tokens

    def tokens_per_s(self, now: float) -> float:
        while self._events and self._events[0][0] < now - self.window_s:
            self._tokens -= self._events.popleft()[1]
        return self._tokens / self.window_s


class ServedRate:
    def __init__(self, window: int = SERVED_WINDOW):
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._waiting = 0
        self._reference_s: float | None = None  # None while no prompt waits

    def waiting(self, now: float) -> None:
        """A prompt was admitted and waits for its first token."""
        if self._waiting == 0:
            self._reference_s = now
        self._waiting += 1

    def answered(self, tokens: int, now: float, completed: bool) -> None:
        """Its first token came back (``completed``), or it ended without one."""
        self._waiting -= 1
        if completed and self._reference_s is not None:
            self._samples.append((tokens, max(now - self._reference_s, 1e-6)))
            self._reference_s = now
        if self._waiting == 0:
            self._reference_s = None

    def tokens_per_s(self) -> float | None:
        """None until MIN_SERVED first tokens were measured."""
        if len(self._samples) < MIN_SERVED:
            return None
        return sum(t for t, _ in self._samples) / sum(s for _, s in self._samples)
