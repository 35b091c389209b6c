"""`pdcluster up` stops everything it started on SIGTERM and on SIGINT: Ray
(its daemons, workers and agents), Serve and the embedded Redis; nothing of
its process tree survives; and everything it started listens on loopback
only, with no loopback settings inherited from the test's environment.
One run has the gateway serve HTTP itself (the default ingress), the other
Serve's proxy in front; both echo exactly one x-request-id."""

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
@pytest.mark.parametrize("sig, ingress", [(signal.SIGTERM, "gateway"), (signal.SIGINT, "serve_proxy")])
def test_up_stops_everything_on_signal(sig, ingress, tmp_path):
    port = free_port()
    log = open(tmp_path / "up.log", "w")
    (tmp_path / "cluster.yaml").write_text(f"mode: colocated\ningress: {ingress}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "UCX_NET_DEVICES")}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--config", str(tmp_path / "cluster.yaml"),
                             "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            if "ready in" in (tmp_path / "up.log").read_text():
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10, headers={"x-request-id": "mine-1"})
                assert r.status_code == 200
                assert r.headers.get_list("x-request-id") == ["mine-1"]
                break
            assert time.monotonic() < deadline, "cluster not ready"
            time.sleep(0.5)
        started = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in started)
        assert non_loopback_listeners([psutil.Process(proc.pid), *started]) == []
        proc.send_signal(sig)
        assert proc.wait(timeout=90) == 0, (tmp_path / "up.log").read_text()
        _, alive = psutil.wait_procs(started, timeout=15)
        assert alive == [], [" ".join(p.cmdline())[:80] for p in alive]
        assert "stopped: Serve, Ray and the embedded Redis are down" in (tmp_path / "up.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def non_loopback_listeners(procs) -> list[str]:
    """'process address:port' for every listening TCP socket of ``procs`` not bound to loopback."""
    found = []
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
                found.append(f"{p.name()} {c.laddr.ip}:{c.laddr.port}")
    return found
