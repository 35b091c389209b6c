"""Suite-wide settings: kernels run under Triton's CPU interpreter, Ray and
UCX stay on loopback.  Torch keeps its default (a thread per core) in a run
of one process, and takes one thread in each xdist worker (`-n 2` on two
cores: two threads each spun against each other, and the engine's
integration tests took 268 s on two workers against 177 s in one process).

`make test` runs the unit tests and the engine's integration tests (one
process, no cluster) at idle CPU priority beside the cluster integration
tests (tests/suite.sh), so a test there may be starved of the CPU for seconds
at any point.  The files in WALL_CLOCK hold verdicts that rest on a short
wall-clock window (a lease deadline a fraction of a second away, a 2 s
transfer timeout, a heartbeat's age): they are
marked ``wall_clock``, and suite.sh runs them first, by themselves, at normal
priority.  A new test whose verdict needs the CPU promptly belongs in this
list; a mere hang guard does not (make it generous instead)."""

import os

import pytest

from pdcluster.services.cluster_env import cluster_env

os.environ.setdefault("TRITON_INTERPRET", "1")
cluster_env()  # loopback, Serve's throughput mode: what `pdcluster up` runs with
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # read by torch when it loads: before any test module imports it
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# PDCLUSTER_TEST_CPU_REPORT=FILE: each test's wall time and machine CPU (tests/cpu_report.py).
from tests.cpu_report import pytest_runtest_protocol, pytest_sessionfinish  # noqa: E402,F401

from tests.wall_clock import WALL_CLOCK  # noqa: E402,F401 - the list suite.sh also reads


def pytest_configure(config):
    config.addinivalue_line("markers", "wall_clock: a test whose verdict rests on a short wall-clock window; "
                                       "make test runs these first, alone (tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.relative_to(config.rootpath).as_posix().startswith(WALL_CLOCK):
            item.add_marker(pytest.mark.wall_clock)
