"""A replica computes with the cores of idle replicas on its host.

On a small machine each replica owns a core or two (``num_threads``), so a
long prompt's prefill runs on one core while the decode replica beside it
may have nothing to do, and a lone stream decodes on one core while the
prefill replica idles.  Every replica publishes its load and its own thread
count on the status board (status_board.py) and keeps a busy byte on its
host (busy_flag.py).  Each replica reads the board a few times a second to
learn its neighbours and what they could lend; before every engine step it
reads their busy bytes::

    neighbours = the other live replicas on this host (same Ray node)
    lendable   = the neighbours' own threads, capped so that own + lendable <= the host's CPUs
    threads    = own + lendable    when no neighbour has a request in flight (busy bytes;
                                   where a byte cannot be read: the board says none runs,
                                   waits or has a request in flight; a dead one is idle)
               = own               otherwise

A neighbour that gets a request sets its byte at once: the borrower gives the
threads back before its next step, so the neighbour shares its cores for at
most one step of the borrower (a decode step, or a prefill chunk).  The
kernels split their work by output rows, so the thread count never changes
a result (tests/unit/services/test_core_lending.py checks the engine's
greedy tokens and logprobs with counts that change every step)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdcluster.services.pools.busy_flag import FlagReader, flag_path
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


@dataclass(frozen=True)
class Lending:
    """What the board says a replica may borrow: ``extra`` threads, while the
    ``neighbours`` (their names) have no request; ``board_idle``: the board's
    own view of that, for when a busy byte cannot be read."""
    extra: int = 0
    neighbours: tuple[str, ...] = ()
    board_idle: bool = False


NOTHING = Lending()


def lending(own: int, me: str, host: str, board: list[dict], cpus: int) -> Lending:
    """The threads a replica named ``me`` could borrow on ``host`` (pure)."""
    neighbours = [s for s in board if s.get("host") == host and s.get("name") != me]
    if not neighbours:
        return NOTHING
    lent = sum(max(int(s.get("threads") or 0), 0) for s in neighbours)
    extra = max(min(own + lent, cpus) - own, 0)
    return Lending(extra, tuple(sorted(str(s.get("name")) for s in neighbours)),
                   all(is_idle(s) for s in neighbours))


def threads_now(own: int, lend: Lending, neighbours_busy: bool | None) -> int:
    """The threads for the next step (pure): ``neighbours_busy`` from their busy
    bytes, None where one cannot be read (then the board's view decides)."""
    idle = lend.board_idle if neighbours_busy is None else not neighbours_busy
    return own + lend.extra if lend.extra and idle else own


class ThreadChooser:
    """The engine's ``threads_source``: called before every step (engine
    thread); ``lend`` is replaced by the board reader (event loop)."""

    def __init__(self, own: int, cluster: str, flag_directory: Path | None = None):
        self.own, self.cluster, self._dir = own, cluster, flag_directory
        self.reader = FlagReader()
        # One assignment: the engine thread never sees a lending with another's flag paths.
        self._state: tuple[Lending, tuple[Path, ...]] = (NOTHING, ())
        self.num_changes = 0
        self._last = own

    @property
    def lend(self) -> Lending:
        return self._state[0]

    def update(self, lend: Lending) -> None:
        old, paths = self._state
        if lend.neighbours != old.neighbours:
            paths = tuple(flag_path(self.cluster, n, self._dir) for n in lend.neighbours)
            self.reader.forget_others(paths)
        self._state = (lend, paths)

    def __call__(self) -> int:
        lend, paths = self._state
        n = threads_now(self.own, lend, self.reader.any_busy(paths) if lend.extra else False)
        if n != self._last:
            self.num_changes += 1
            self._last = n
        return n


async def borrow_forever(redis_url: str, cluster: str, me: str, own: int,
                         apply: Callable[[Lending], None], period_s: float = READ_PERIOD_S) -> None:
    """Background task of a replica: reads the board every ``period_s`` and
    ``apply``s what it may borrow when that changes.  A board it cannot read
    means nothing to borrow (lending needs to know the neighbours)."""
    import redis.asyncio as aioredis

    host, cpus, current = host_id(), host_cpus(), NOTHING
    client = aioredis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        while True:
            try:
                wanted = lending(own, me, host, await read_statuses(client, cluster), cpus)
            except Exception as exc:  # noqa: BLE001 - Redis away: keep to our own cores
                log.debug("status board unreadable (%s): computing on own threads", exc)
                wanted = NOTHING
            if wanted != current:
                apply(wanted)
                current = wanted
            await asyncio.sleep(period_s)
    finally:
        if current != NOTHING:
            apply(NOTHING)
        await client.aclose()
