"""How busy the rest of the machine was while a bench ran: CPU seconds the
whole machine spent minus those of this process and its descendants (the
cluster it started), per second of the run.  On a shared machine this is
the figure that says whether a measurement is noise."""

from __future__ import annotations

import time


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its descendants)."""
    import psutil

    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)
    own = 0.0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            c = proc.cpu_times()
            own += c.user + c.system
        except psutil.Error:
            pass
    return busy, own


class OtherLoad:
    """``start()`` then ``cores()``: cores used by processes outside this run's tree since the start.
    A child that exits before ``cores()`` counts as another process's (psutil no longer sees it)."""

    def start(self) -> OtherLoad:
        self._busy, self._own = cpu_seconds()
        self._t = time.monotonic()
        return self

    def cores(self) -> float:
        busy, own = cpu_seconds()
        return max((busy - self._busy) - (own - self._own), 0.0) / max(time.monotonic() - self._t, 1e-9)
