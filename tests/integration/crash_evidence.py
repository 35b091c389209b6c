"""What a failed cluster test prints about processes that died during it.

A replica that dies of a signal leaves Ray's one generic line ("A worker
died or was killed ... (1) the OOM killer ... (3) SIGSEGV ...") and nothing
that says which.  CI keeps no logs, so the failure report itself carries the
evidence: the kernel's OOM-kill and segfault lines logged during the test
(``dmesg``, where readable), Serve's controller's warnings and errors of
the test's time (a replica that crashed, or failed its health check), and
the Python stacks that a replica's faulthandler (PYTHONFAULTHANDLER,
pdcluster/services/cluster_env.py) wrote to its Ray worker log when a fatal
signal ended it.  Read only after a failure; never raises."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

KERNEL_PATTERN = re.compile(r"out of memory|oom-kill|killed process|segfault|traps:|general protection", re.I)
FATAL_MARK = "Fatal Python error"
STACK_LINES = 40
CONTROLLER_LINES = 30


def kernel_lines(dmesg_text: str, since_uptime_s: float) -> list[str]:
    """The lines of ``dmesg`` output (``[ seconds] text``) at or after
    ``since_uptime_s`` that report an OOM kill or a crash."""
    found = []
    for line in dmesg_text.splitlines():
        m = re.match(r"\[\s*(\d+\.\d+)\]", line)
        if m and float(m.group(1)) >= since_uptime_s and KERNEL_PATTERN.search(line):
            found.append(line)
    return found


def fatal_stacks(log_text: str) -> list[str]:
    """From a worker's stderr log: each faulthandler report, its first
    STACK_LINES lines."""
    lines, found = log_text.splitlines(), []
    for i, line in enumerate(lines):
        if FATAL_MARK in line:
            found.extend(lines[i:i + STACK_LINES])
    return found


def controller_lines(log_text: str, since_epoch_s: float) -> list[str]:
    """Serve controller log lines (``LEVEL YYYY-MM-DD HH:MM:SS,mmm ...``, local
    time) at WARNING or ERROR from ``since_epoch_s`` on; the last CONTROLLER_LINES."""
    found = []
    for line in log_text.splitlines():
        m = re.match(r"(WARNING|ERROR) (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", line)
        if m and time.mktime(time.strptime(m.group(2), "%Y-%m-%d %H:%M:%S")) >= int(since_epoch_s):
            found.append(line)
    return found[-CONTROLLER_LINES:]


def uptime_s() -> float:
    try:
        return float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def ray_logs_dir() -> Path | None:
    try:
        import ray

        node = ray._private.worker._global_node  # noqa: SLF001 - the session's own log folder
        return Path(node.get_logs_dir_path()) if node is not None else None
    except Exception:  # noqa: BLE001 - evidence is best effort
        return None


def report(since_uptime_s: float, since_epoch_s: float) -> str:
    """The evidence of deaths since the test began, or ''."""
    try:
        return _report(since_uptime_s, since_epoch_s)
    except Exception as exc:  # noqa: BLE001 - the test's own failure must come through
        return f"(no evidence read: {exc!r})"


def _report(since_uptime_s: float, since_epoch_s: float) -> str:
    parts: list[str] = []
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, errors="replace", timeout=5).stdout
        lines = kernel_lines(out, since_uptime_s)
        if lines:
            parts.append("kernel (dmesg):\n" + "\n".join(lines))
    except (OSError, subprocess.SubprocessError):
        pass
    logs = ray_logs_dir()
    if logs is not None:
        for path in sorted(logs.glob("serve/controller_*.log")):
            try:
                lines = controller_lines(path.read_text(errors="replace"), since_epoch_s)
            except (OSError, ValueError):   # unreadable, or a date that does not parse
                continue
            if lines:
                parts.append(f"serve/{path.name}:\n" + "\n".join(lines))
        for path in sorted(logs.glob("worker-*.err")):
            try:
                if path.stat().st_mtime < since_epoch_s:
                    continue
                stacks = fatal_stacks(path.read_text(errors="replace"))
            except OSError:
                continue
            if stacks:
                parts.append(f"{path.name}:\n" + "\n".join(stacks))
    return "\n\n".join(parts)
