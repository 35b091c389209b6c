"""Reservations that wait in line on the engine thread (vLLM v1 keeps such
requests WAITING_FOR_REMOTE_KVS): a decode replica whose pool cannot hold a
hand-off's blocks now queues the reservation here instead of asking again
every few milliseconds.  The engine thread tries the line, oldest first,
each turn of its loop (after the step or the commands that may have freed
blocks); the first one that still does not fit stops the pass, so a large
hand-off is not overtaken for ever by small ones.

Only the engine thread calls ``offer``, ``serve`` and ``fail_all``; callers
wait on the concurrent future they passed in and cancel it when they give up
(a reservation made as they gave up is handed to ``undo``)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Waiting:
    attempt: Callable[[], Any]          # the reservation: its result, or None while it does not fit
    future: concurrent.futures.Future   # the caller's
    undo: Callable[[Any], Any]          # frees a result nobody will take


class ReservationLine:
    def __init__(self) -> None:
        self._line: deque[_Waiting] = deque()

    def __len__(self) -> int:
        return len(self._line)

    def offer(self, attempt: Callable[[], Any], future: concurrent.futures.Future,
              undo: Callable[[Any], Any]) -> None:
        """Tries ``attempt`` now if nobody waits ahead of it; else (or if it does not fit) it joins the line."""
        waiting = _Waiting(attempt, future, undo)
        if self._line or not self._try(waiting):
            self._line.append(waiting)

    def serve(self) -> int:
        """Tries the line oldest first until one does not fit; returns how many were reserved."""
        served = 0
        while self._line:
            if not self._try(self._line[0]):
                break
            self._line.popleft()
            served += 1
        return served

    def fail_all(self, error: BaseException) -> None:
        while self._line:
            waiting = self._line.popleft()
            if not waiting.future.done():
                waiting.future.set_exception(error)

    def _try(self, waiting: _Waiting) -> bool:
        """True when ``waiting`` is settled: reserved (or failed) and handed over, or its caller left."""
        if waiting.future.done():  # the caller gave up while it waited
            return True
        try:
            result = waiting.attempt()
        except Exception as exc:  # noqa: BLE001 - handed to the caller (a bad request, say)
            _settle(waiting.future, exc=exc)
            return True
        if result is None:
            return False
        if not _settle(waiting.future, result=result):
            waiting.undo(result)  # the caller left just now: its blocks go back
        return True


def _settle(future: concurrent.futures.Future, result: Any = None, exc: BaseException | None = None) -> bool:
    """Sets the future unless the caller cancelled it meanwhile; False then."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
        return True
    except concurrent.futures.InvalidStateError:
        return False
