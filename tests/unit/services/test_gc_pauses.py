"""pdcluster/services/gc_pauses.py: start-up objects leave the collector's walk; a slow collection is logged."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest

from pdcluster.services import gc_pauses


class _Node:
    me: "_Node"


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()
    if gc_pauses._log_slow_collection in gc.callbacks:
        gc.callbacks.remove(gc_pauses._log_slow_collection)


def test_freezing_moves_the_live_objects_out_of_collections(unfrozen):
    held = [[i] for i in range(20_000)]   # live, tracked objects, like a loaded replica's
    frozen = gc_pauses.freeze_startup_heap()
    # Frozen objects freed since (a finalizer or another thread dropping the last reference) leave
    # the count: it can only have fallen, and never below the objects still held.
    assert frozen >= len(held) and len(held) <= gc.get_freeze_count() <= frozen
    assert all(not any(o is h for o in gc.get_objects(generation=2)) for h in held[:3])
    cycle = _Node()
    cycle.me = cycle          # a cycle made after start-up is still collected
    gone = weakref.ref(cycle)
    del cycle
    gc.collect()              # by this call, or by an automatic collection another thread set off first
    assert gone() is None


def test_a_slow_collection_is_logged(monkeypatch, caplog):
    assert gc_pauses._log_slow_collection not in gc.callbacks   # only the calls below reach it
    clock = iter([10.0, 10.0 + gc_pauses.SLOW_COLLECTION_S + 0.05, 20.0, 20.01])
    monkeypatch.setattr(gc_pauses, "_clock", lambda: next(clock))
    with caplog.at_level(logging.WARNING, logger=gc_pauses.__name__):
        gc_pauses._log_slow_collection("start", {"generation": 2})
        gc_pauses._log_slow_collection("stop", {"generation": 2, "collected": 7})
        gc_pauses._log_slow_collection("start", {"generation": 0})
        gc_pauses._log_slow_collection("stop", {"generation": 0, "collected": 1})
    assert len(caplog.records) == 1 and "generation-2" in caplog.text and "0.150 s" in caplog.text
