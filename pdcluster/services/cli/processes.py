"""Ending processes we started: wait a grace period, then kill what is left."""

from __future__ import annotations


def reap(procs: list, grace_s: float = 10.0) -> None:
    """Waits up to ``grace_s`` for ``procs`` (psutil.Process) to exit, kills
    the stragglers, and waits for those (a dead one is never an error)."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
