"""pdcluster/services/engine/turn_clock.py: a slow engine turn is logged with its parts and its CPU time."""

from __future__ import annotations

import logging

from pdcluster.services.engine import turn_clock
from pdcluster.services.engine.turn_clock import TurnClock


def test_a_fast_turn_is_not_logged(caplog):
    clock = TurnClock()
    clock.mark("step")
    with caplog.at_level(logging.WARNING):
        assert not clock.log_if_slow(logging.getLogger("t"), 7)
    assert not caplog.records


def test_a_slow_turn_names_its_parts_and_cpu(monkeypatch, caplog):
    ticks = iter([100.0, 100.01, 100.01 + turn_clock.SLOW_TURN_S])
    monkeypatch.setattr(turn_clock.time, "perf_counter", lambda: next(ticks))
    clock = TurnClock()
    clock.mark("commands")
    clock.mark("step")
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING):
        assert clock.log_if_slow(logging.getLogger("t"), 42)
    text = caplog.text
    assert "turn 42" in text and "commands 0.010 s" in text and f"step {turn_clock.SLOW_TURN_S:.3f} s" in text
    assert "of this thread's CPU" in text
