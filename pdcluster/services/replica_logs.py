"""Our loggers (``pdcluster.*``) in each Serve replica's own log file.

Serve writes a replica's log (``<session>/logs/serve/replica_<app>_<deployment>_<id>.log``,
what the Ray dashboard shows for the replica) through the ``ray.serve`` logger
only.  Ours propagated to the root logger, which has no handler in a Ray
worker: INFO records were dropped (the replica's start-up profile, the
garbage-collection freeze, a placement's reason), and a WARNING reached the
file only through Python's last-resort handler writing to the redirected
stderr, without its level, logger or time.  In a replica, ``into_replica_log``
gives the ``pdcluster`` logger the ``ray.serve`` logger's handlers (its file,
its format, its request context), at INFO.  Elsewhere (the CLI, a test, a
script) nothing changes: the caller's logging configuration stands.

It also keeps those handlers out of reach of ``logging.config.dictConfig``,
which closes every handler in the process before it configures its own:
uvicorn (the gateway's HTTP server) and nixl (its logging module, on first
use) both call it, after Serve set its logger up.  Serve's buffering handler
closed loses its target, so from then on it wrote nothing and kept every
record in memory: the gateway's log ended at "Started initializing replica.",
a NIXL replica's at its start-up profile.  Leaving Serve's handlers (and
their targets) out of ``logging._handlerList``, the list ``dictConfig``
closes, keeps them writing; they flush every record (cluster_env.py's
``RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE``), so nothing waits for the
interpreter's exit to be written."""

from __future__ import annotations

import logging

PRODUCT_LOGGER = "pdcluster"
SERVE_LOGGER = "ray.serve"


def in_serve_replica() -> bool:
    try:
        from ray.serve.context import _get_internal_replica_context
    except ImportError:
        return False
    return _get_internal_replica_context() is not None


def into_replica_log(level: int = logging.INFO) -> bool:
    """Routes ``pdcluster.*`` records to this replica's Serve log; False (nothing changed)
    outside a replica or before Serve configured its logger.  Idempotent."""
    serve_handlers = logging.getLogger(SERVE_LOGGER).handlers
    if not serve_handlers or not in_serve_replica():
        return False
    ours = logging.getLogger(PRODUCT_LOGGER)
    ours.handlers = list(serve_handlers)
    ours.setLevel(level)
    ours.propagate = False  # the root's last-resort stderr copy would write each warning twice
    unclosable(serve_handlers)
    return True


def unclosable(handlers) -> None:
    """``handlers`` and their targets (a MemoryHandler's) out of ``logging._handlerList``,
    which ``logging.config.dictConfig`` and ``logging.shutdown`` close."""
    kept = {id(h) for h in handlers} | {id(getattr(h, "target", None)) for h in handlers} - {id(None)}
    lock = getattr(logging, "_lock", None)  # 3.13; 3.11 and 3.12: _acquireLock / _releaseLock
    acquire, release = (lock.acquire, lock.release) if lock else (logging._acquireLock, logging._releaseLock)
    acquire()
    try:
        logging._handlerList[:] = [ref for ref in logging._handlerList if id(ref()) not in kept]
    finally:
        release()
