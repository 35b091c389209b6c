"""Where the suite's time goes, by test: with PDCLUSTER_TEST_CPU_REPORT=FILE,
each test's wall time (setup, call and teardown together) and the CPU the
whole machine spent meanwhile (from /proc/stat, so Ray's processes and the
replicas count too), written to FILE as tab-separated lines, slowest first
(an xdist worker writes FILE.gw0, FILE.gw1, ...).  Under `make test` the unit
tests run beside the integration tests, so each half's figures include the
other's CPU: for one half's own, run it alone.
A test whose machine CPU is far below cores x wall waits on something (a
start, a timer, a poll); one near it computes.  Off unless the variable is
set; Linux only."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPORT_ENV = "PDCLUSTER_TEST_CPU_REPORT"


@dataclass(frozen=True)
class Spent:
    nodeid: str
    wall_s: float
    busy_core_s: float  # every process on the machine, user + system + nice + irq + steal

    def line(self, cores: int) -> str:
        idle = max(cores * self.wall_s - self.busy_core_s, 0.0)
        return f"{self.wall_s:8.2f}\t{self.busy_core_s:8.2f}\t{idle:8.2f}\t{self.nodeid}"


def busy_core_seconds(stat_text: str, ticks_per_s: float) -> float:
    """CPU seconds the machine spent on anything but idle and I/O wait, from
    /proc/stat's first line ("cpu user nice system idle iowait irq softirq steal ...")."""
    fields = stat_text.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu":
        raise ValueError(f"not /proc/stat: {stat_text[:40]!r}")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / ticks_per_s


def _busy_now() -> float:
    return busy_core_seconds(Path("/proc/stat").read_text(), os.sysconf("SC_CLK_TCK"))


_COSTS: list[Spent] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get(REPORT_ENV):
        yield
        return
    wall, busy = time.monotonic(), _busy_now()
    yield
    _COSTS.append(Spent(item.nodeid, time.monotonic() - wall, _busy_now() - busy))


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(REPORT_ENV)
    if not path or not _COSTS:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # an xdist worker: a file of its own beside FILE (FILE.gw0, FILE.gw1, ...)
        path = f"{path}.{worker}"
    cores = os.cpu_count() or 1
    lines = [c.line(cores) for c in sorted(_COSTS, key=lambda c: -c.wall_s)]
    wall, busy = sum(c.wall_s for c in _COSTS), sum(c.busy_core_s for c in _COSTS)
    header = (f"# {len(_COSTS)} tests, {wall:.1f} s wall, machine busy {busy:.1f} core-s of {cores * wall:.1f} "
              f"({cores} cores)\n# wall_s\tbusy_core_s\tidle_core_s\ttest\n")
    Path(path).write_text(header + "\n".join(lines) + "\n")
