"""`pdcluster up` stops everything it started on SIGINT: Ray (its daemons,
workers and agents), Serve and the embedded Redis; nothing of its process
tree survives; and everything it started listens on loopback only, with no
loopback settings inherited from the test's environment.  The cluster is a
colocated one behind Serve's proxy: the moment its /health first says 200,
ten requests sent at once all succeed (readiness never lies), and it echoes
exactly one x-request-id.  The SIGTERM half (the default disaggregated
cluster, gateway ingress) runs in test_no_secrets_in_output.py, whose
`pdcluster up` also checks that no secret leaks and that SIGTERM drains the
streams in flight: one cluster start, not three."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pdcluster.prefix_store.redis_server import free_service_port

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.parametrize("sig, mode, ingress", [(signal.SIGINT, "colocated", "serve_proxy")])
def test_up_stops_everything_on_signal(sig, mode, ingress, tmp_path):
    port = free_service_port()
    log = open(tmp_path / "up.log", "w")
    (tmp_path / "cluster.yaml").write_text(f"mode: {mode}\ningress: {ingress}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "UCX_NET_DEVICES")}
    proc = subprocess.Popen([sys.executable, "-m", "pdcluster.services.cli.main", "up", "--config", str(tmp_path / "cluster.yaml"),
                             "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            if health_is_200(port):
                statuses = first_requests(port, 10)
                assert statuses == [200] * 10, statuses
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10, headers={"x-request-id": "mine-1"})
                assert r.status_code == 200
                assert r.headers.get_list("x-request-id") == ["mine-1"]
                break
            assert time.monotonic() < deadline, "cluster not ready"
            time.sleep(0.1)  # catch the first 200
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


def health_is_200(port: int, host: str = "127.0.0.1") -> bool:
    try:
        return httpx.get(f"http://{host}:{port}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def first_requests(port: int, n: int, host: str = "127.0.0.1", api_key: str | None = None) -> list[int]:
    """``n`` chat requests sent at once (as a client that trusts /health would)."""
    import asyncio

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async def send_all() -> list[int]:
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
        async with httpx.AsyncClient(timeout=120, headers=headers) as http:
            rs = await asyncio.gather(*(http.post(f"http://{host}:{port}/v1/chat/completions", json=body)
                                        for _ in range(n)))
        return [r.status_code for r in rs]

    return asyncio.run(send_all())


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
