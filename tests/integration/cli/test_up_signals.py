"""`pdcluster up` stops everything it started on SIGTERM and on SIGINT: Ray
(its daemons, workers and agents), Serve and the embedded Redis; nothing of
its process tree survives."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from prefix_store.redis_server import free_port

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_stops_everything_on_signal(sig, tmp_path):
    port = free_port()
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--mode", "colocated", "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            if "ready in" in (tmp_path / "up.log").read_text():
                assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
                break
            assert time.monotonic() < deadline, "cluster not ready"
            time.sleep(0.5)
        started = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in started)
        proc.send_signal(sig)
        assert proc.wait(timeout=90) == 0, (tmp_path / "up.log").read_text()
        _, alive = psutil.wait_procs(started, timeout=15)
        assert alive == [], [" ".join(p.cmdline())[:80] for p in alive]
        assert "stopped: Serve, Ray and the embedded Redis are down" in (tmp_path / "up.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
