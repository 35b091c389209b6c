"""`pdcluster up` drains on SIGTERM (issue 37): six streams in flight when the
signal arrives all finish, a request sent after it gets 503 with
Retry-After, /ready fails while /live answers, and the whole process tree is
gone within shutdown_timeout_s + 10 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pdcluster.prefix_store.redis_server import free_service_port

pytestmark = [pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[3]
SHUTDOWN_TIMEOUT_S = 30
STREAMS, MAX_TOKENS = 6, 48
READY_TIMEOUT_S = 300


def ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def stream(base: str, i: int, first_token: threading.Event, out: dict) -> None:
    body = {"prompt": f"Stream {i}: list animals,", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens, finish = 0, None
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=180) as r:
            out[f"status{i}"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    first_token.set()
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as exc:
        out[f"error{i}"] = repr(exc)
    out[i] = (tokens, finish)


def test_sigterm_drains_streams_then_stops(tmp_path):
    port = free_service_port()
    base = f"http://127.0.0.1:{port}"
    (tmp_path / "cluster.yaml").write_text(f"shutdown_timeout_s: {SHUTDOWN_TIMEOUT_S}\n")
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pdcluster.services.cli.main", "up", "--config",
                             str(tmp_path / "cluster.yaml"), "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready(base):
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "cluster not ready"
            time.sleep(0.5)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        out: dict = {}
        firsts = [threading.Event() for _ in range(STREAMS)]
        threads = [threading.Thread(target=stream, args=(base, i, firsts[i], out), daemon=True)
                   for i in range(STREAMS)]
        for t in threads:
            t.start()
        for e in firsts:
            assert e.wait(120), f"a stream never got its first token: {out}"
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        refused = None   # a request sent after the signal: 503 once the gateway drains
        while refused is None and time.monotonic() < signalled + SHUTDOWN_TIMEOUT_S:
            r = httpx.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=60)
            if r.status_code == 503:
                refused = r
            else:
                assert r.status_code == 200, r.text   # sent before the drain began: served
                time.sleep(0.1)
        assert refused is not None, "no request was refused after SIGTERM"
        assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "draining"
        assert httpx.get(f"{base}/ready", timeout=10).status_code == 503 or not threads[0].is_alive()

        for t in threads:
            t.join(timeout=SHUTDOWN_TIMEOUT_S + 10)
        assert [out.get(i) for i in range(STREAMS)] == [(MAX_TOKENS, "length")] * STREAMS, out
        assert proc.wait(timeout=max(1.0, signalled + SHUTDOWN_TIMEOUT_S + 10 - time.monotonic())) == 0
        _, alive = psutil.wait_procs(tree[1:], timeout=max(1.0, signalled + SHUTDOWN_TIMEOUT_S + 10
                                                         - time.monotonic()))
        assert alive == [], [" ".join(p.cmdline())[:80] for p in alive]
        text = (tmp_path / "up.log").read_text()
        assert "drained: every request finished" in text, text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
