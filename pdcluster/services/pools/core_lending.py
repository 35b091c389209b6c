"""A prefill replica computes with the cores of idle replicas on its host.

On a small machine each replica owns a core or two (``num_threads``), so a
long prompt's prefill runs on one core while the decode replica beside it
may have nothing to do.  Every replica publishes its load and its own
thread count on the status board (status_board.py); a prefill replica reads
the board a few times a second and, while every other replica on its host
is idle, runs its native kernels on their threads too::

    neighbours = the other live replicas on this host (same Ray node)
    threads    = own + the neighbours' own threads      when none of them runs, waits or has
                                                        a request in flight (a dead one counts
                                                        as idle: its cores are free)
               = own                                    otherwise
    capped at the host's CPUs

A neighbour that gets work shows it on its next publish (status_board's
period): the borrower gives the threads back at its next read, so the
neighbour shares its cores for at most a read period plus one prefill step.
The kernels split their work by output rows, so the thread count never
changes a result (tests/unit/pools/test_core_lending.py checks the engine's
greedy tokens with both counts)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from pdcluster.services.pools.status_board import read_statuses

log = logging.getLogger("pdcluster.core_lending")
READ_PERIOD_S = 0.25
_BUSY_KEYS = ("running", "waiting", "awaiting_kv", "in_flight")


def host_id() -> str:
    """This process's host as the board names it: the Ray node, else the host name."""
    try:
        import ray
        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray: the host name
        pass
    return os.uname().nodename


def host_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def is_idle(status: dict) -> bool:
    """Whether a board entry's replica has nothing to compute (a dead engine has nothing either)."""
    return not status.get("engine_alive", True) or not any(status.get(k) for k in _BUSY_KEYS)


def borrowed_threads(own: int, me: str, host: str, board: list[dict], cpus: int) -> int:
    """The threads a replica named ``me`` computes with (pure; see the module docstring)."""
    neighbours = [s for s in board if s.get("host") == host and s.get("name") != me]
    if not neighbours or not all(is_idle(s) for s in neighbours):
        return own
    lent = sum(max(int(s.get("threads") or 0), 0) for s in neighbours)
    return max(own, min(own + lent, cpus))


async def borrow_forever(redis_url: str, cluster: str, me: str, own: int,
                         apply: Callable[[int], None], period_s: float = READ_PERIOD_S) -> None:
    """Background task of a prefill replica: reads the board every ``period_s``
    and ``apply``s the thread count when it changes.  A board it cannot read
    means its own threads (lending needs to see that the neighbours are idle)."""
    import redis.asyncio as aioredis

    host, cpus, current = host_id(), host_cpus(), own
    client = aioredis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        while True:
            try:
                wanted = borrowed_threads(own, me, host, await read_statuses(client, cluster), cpus)
            except Exception as exc:  # noqa: BLE001 - Redis away: keep to our own cores
                log.debug("status board unreadable (%s): computing on own threads", exc)
                wanted = own
            if wanted != current:
                apply(wanted)
                current = wanted
            await asyncio.sleep(period_s)
    finally:
        if current != own:
            apply(own)
        await client.aclose()
