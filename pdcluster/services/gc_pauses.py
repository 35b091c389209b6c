"""Keeps Python's cyclic garbage collector from pausing a replica's streams.

A replica holds about half a million GC-tracked objects once torch, Ray
Serve, the tokenizer and the model are loaded.  A full (generation 2)
collection walks every one of them: 0.21-0.23 s on the quiet 2-core test
machine, 0.4-0.7 s when the cores are shared -- a stall of every stream the
replica decodes (tests/integration/cluster/test_cluster_grammar_isolation.py
saw single gaps of 0.43 and 0.68 s between two tokens).  Those objects live
as long as the process, so after start-up they are moved to the permanent
generation (``gc.freeze``), which collections skip; what a request creates
is still collected.  A collection that still takes long is logged."""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

SLOW_COLLECTION_S = 0.1   # a collection this long shows as a gap in a stream: logged
_started: dict[int, float] = {}
_clock = time.perf_counter


def freeze_startup_heap() -> int:
    """Collects once, then freezes every object alive now (call when start-up is done);
    returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    if _log_slow_collection not in gc.callbacks:
        gc.callbacks.append(_log_slow_collection)
    return gc.get_freeze_count()


def _log_slow_collection(phase: str, info: dict) -> None:
    generation = info.get("generation", -1)
    if phase == "start":
        _started[generation] = _clock()
        return
    now = _clock()
    took = now - _started.pop(generation, now)
    if took >= SLOW_COLLECTION_S:
        log.warning("a generation-%d garbage collection paused this process %.3f s (%d objects collected)",
                    generation, took, info.get("collected", 0))
