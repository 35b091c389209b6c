"""The files whose verdicts rest on a short wall-clock window (see
tests/conftest.py): marked ``wall_clock`` there, and run first, by themselves,
at normal priority by tests/suite.sh, which collects only these paths
(`python -m tests.wall_clock` prints them, one per line)."""

WALL_CLOCK = (
    "tests/unit/transfer/",                              # lease deadlines and 1-5 s transfer timeouts
    "tests/unit/bench/",                                 # load generators timing fake servers (a profile's fit)
    "tests/unit/telemetry/",                             # the engine clock mapped to the wall clock within 50 ms
    "tests/unit/engine/test_async_engine_loop.py",       # heartbeat ages
    "tests/unit/services/test_peer_fetch.py",            # a lease 0.1 s from its deadline
    "tests/unit/openai/test_openai_live.py",             # a stream's abort seen within 5 s
    "tests/integration/engine/test_engine_isolation.py",  # reservations and leases of 0.1-0.3 s
)


if __name__ == "__main__":
    print("\n".join(WALL_CLOCK))
