"""Prefix indexes by URL scheme: ``make_index(url, cluster=, model=)``.

The interface and its contract are pdcluster.prefix_store.index_base (re-exported
here); this module is the explicit table of the implementations and imports
them, nothing imports it back.  A new store: implement ``PrefixIndex`` in its
own module with a ``from_url(url, *, cluster, model, **options)`` factory and
add it to ``INDEXES``.
"""

from __future__ import annotations

from collections.abc import Callable

from pdcluster.prefix_store import memory_index, redis_index
from pdcluster.prefix_store.index_base import (
    HeartbeatStatus, IndexCounters, IndexUnavailable, LookupResult, PrefixIndex, PurgeReport,
)
from pdcluster.prefix_store.redis_url import redact_url

__all__ = ["INDEXES", "HeartbeatStatus", "IndexCounters", "IndexUnavailable", "LookupResult", "PrefixIndex",
           "PurgeReport", "make_index"]

IndexFactory = Callable[..., PrefixIndex]
INDEXES: dict[str, IndexFactory] = {
    "memory": memory_index.from_url,
    "redis": redis_index.from_url,
}


def make_index(url: str | None, *, cluster: str, model: str, **options) -> PrefixIndex:
    """``url`` is ``redis://[:password@]host:port[/db]`` or ``memory://`` (or None)."""
    scheme = "memory" if not url else url.split("://", 1)[0]
    if scheme not in INDEXES:
        raise ValueError(f"prefix index URL {redact_url(url)!r}: unknown scheme {scheme!r}; use one of "
                         f"{sorted(INDEXES)} (e.g. redis://127.0.0.1:6379 or memory://)")
    return INDEXES[scheme](url, cluster=cluster, model=model, **options)
