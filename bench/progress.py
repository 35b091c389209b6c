"""The live progress bar of a run: done/total (or elapsed/duration), requests
in flight, errors so far.  A no-op when disabled (tests, --no-progress)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


class RunProgress:
    def __init__(self, label: str, total_requests: int | None, duration_s: float | None, enabled: bool = True) -> None:
        self.enabled = enabled
        self.total_requests = total_requests
        self.duration_s = duration_s
        self.in_flight = self.done = self.errors = 0
        self._t0 = time.perf_counter()
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        total = total_requests if total_requests is not None else duration_s
        self._task = self._progress.add_task(label, total=total, status="")

    def __enter__(self) -> "RunProgress":
        self._t0 = time.perf_counter()
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._refresh()
        self._progress.__exit__(*exc)

    def sent(self) -> None:
        self.in_flight += 1
        self._refresh()

    def finished(self, ok: bool) -> None:
        self.in_flight -= 1
        self.done += 1
        self.errors += 0 if ok else 1
        self._refresh()

    def tick(self) -> None:
        self._refresh()

    def _refresh(self) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self._t0
        if self.total_requests is not None:
            completed = self.done
            counts = f"{self.done}/{self.total_requests} done"
        else:
            completed = min(elapsed, self.duration_s or elapsed)
            counts = f"{self.done} done"
        status = f"{counts}  {self.in_flight} in flight  {self.errors} errors"
        self._progress.update(self._task, completed=completed, status=status)
