"""`make test` runs the unit tests at idle CPU priority beside the integration
tests (tests/suite.sh), so a unit test there may be starved of the CPU for
seconds at any point.  The files below hold verdicts that rest on a short
wall-clock window (a lease deadline a fraction of a second away, a 2 s
transfer timeout, a heartbeat's age, a compile's wall backstop): they are
marked ``wall_clock``, and suite.sh runs them first, by themselves, at normal
priority.  A new test whose verdict needs the CPU promptly belongs in this
list; a mere hang guard does not (make it generous instead)."""

from __future__ import annotations

import pytest

WALL_CLOCK = (
    "tests/unit/transfer/",                              # lease deadlines and 1-5 s transfer timeouts
    "tests/unit/bench/",                                 # load generators timing fake servers (a profile's fit)
    "tests/unit/telemetry/",                             # the engine clock mapped to the wall clock within 50 ms
    "tests/unit/engine/test_async_engine_loop.py",       # heartbeat ages
    "tests/unit/engine/test_lease_reads.py",             # a lease's expiry on the monotonic clock
    "tests/unit/engine/test_grammar.py",                 # compile limits with a wall-clock backstop
    "tests/unit/engine/test_grammar_compile_pool.py",
    "tests/unit/services/test_peer_fetch.py",            # a lease 0.1 s from its deadline
    "tests/unit/openai/test_openai_live.py",             # a stream's abort seen within 5 s
)


def pytest_configure(config):
    config.addinivalue_line("markers", "wall_clock: a unit test whose verdict rests on a short wall-clock window; "
                                       "make test runs these first, alone (tests/unit/conftest.py)")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.relative_to(config.rootpath).as_posix().startswith(WALL_CLOCK):
            item.add_marker(pytest.mark.wall_clock)
