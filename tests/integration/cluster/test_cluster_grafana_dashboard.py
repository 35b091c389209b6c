"""The shipped Grafana dashboard (deploy/grafana/pdcluster.json) against a
real Prometheus scraping the live session cluster's gateway: every panel's
PromQL returns data.  Prometheus is Debian's package, started here on a free
loopback port with its own tmp storage; without the binary the test skips."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from pdcluster.observability.dashboard_plot import expr_for_prometheus, render
from pdcluster.prefix_store.redis_server import free_service_port

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"
DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "pdcluster.json"
INSTALL = "apt-get update && apt-get install -y prometheus"


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) with Grafana's variables as this test's Prometheus sees them."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = expr_for_prometheus(target["expr"], MODEL)
            assert "$" not in expr, f"{panel['title']}: a Grafana variable the test does not know: {expr}"
            out.append((panel["title"], expr))
    return out


@pytest.fixture
def prometheus(tmp_path, cluster):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(f"no prometheus binary: install it with `{INSTALL}`")
    port = free_service_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: pdcluster\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{cluster.config.port}']}}]\n")
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", "--storage.tsdb.retention.time=1h"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, tmp_path / "prometheus.log")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 90.0) -> None:
    """Until Prometheus answers /-/ready with 200: before that its query API answers 503
    (its storage still opening), which failed this test once on a busy machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/-/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, f"prometheus exited {proc.returncode}: {log.read_text()[-800:]}"
        assert time.monotonic() < deadline, f"prometheus not ready in {timeout_s:g} s: {log.read_text()[-800:]}"
        time.sleep(0.25)


def query(prom: str, expr: str) -> list:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, f"{expr}: {r.text}"
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_until(prom: str, expr: str, timeout_s: float = 45.0) -> list:
    """Polls ``expr`` until it returns data (Prometheus may still be starting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = query(prom, expr)
        except httpx.TransportError:
            result = []
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_every_dashboard_panel_returns_data(prometheus, client):
    queries = panel_queries(json.loads(DASHBOARD.read_text()))
    assert len({title for title, _ in queries}) >= 10
    assert wait_until(prometheus, 'up{job="pdcluster"} == 1'), "Prometheus never scraped the gateway"
    for i in range(4):   # traffic between scrapes: every rate() in the window has something to count
        client.completions.create(model=MODEL, prompt=f"Request {i}: say something.", max_tokens=8,
                                  temperature=0)
    moved = wait_until(prometheus, f'increase(vllm:e2e_request_latency_seconds_count{{model_name="{MODEL}"}}[1m]) > 0'
                       f' and on() increase(pdcluster_kv_transfer_bytes_total[1m]) > 0')
    assert moved, "the requests never showed in Prometheus"
    empty = [(title, expr) for title, expr in queries if not query(prometheus, expr)]
    assert not empty, "panels without data:\n" + "\n".join(f"  {t}: {e}" for t, e in empty)
    if os.environ.get("PDCLUSTER_DASHBOARD_PNG"):   # docs/operating.md's picture, drawn from this very data
        assert render(prometheus, Path(os.environ["PDCLUSTER_DASHBOARD_PNG"]), MODEL, minutes=2) > 0
