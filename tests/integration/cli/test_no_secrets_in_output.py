"""No secret leaves a running cluster in anything an operator reads: a real
`pdcluster up` with an API key and a cluster secret in its environment (and
its embedded Redis's generated password) serves a few requests; then its own
output, `pdcluster status` (table and JSON), the span file, every Ray session
log and every command line of its process tree hold none of the three, the
state file is 0600, and the span file holds no prompt text; nor does the
Ray dashboard's ``/api/serve/applications/`` (Serve's config as shown to
its visitors).

SIGTERM then drains it (issue 37): six streams in flight when the signal
arrives all finish, a request sent after it gets 503 with Retry-After,
/ready fails, and it exits 0 with nothing of its process tree left within
shutdown_timeout_s + 10 s.  This is also the SIGTERM half of
test_up_signals.py (the default disaggregated cluster, gateway ingress, ten
requests at the first /health 200 all succeed): one `pdcluster up` for the
three checks, not three."""

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx
import psutil
import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.prefix_store.redis_url import url_password
from tests.integration.cli.test_up_signals import first_requests, health_is_200, non_loopback_listeners

pytestmark = [pytest.mark.slow, pytest.mark.integration]

READY_TIMEOUT_S = 300
SHUTDOWN_TIMEOUT_S = 30
STREAMS, MAX_TOKENS = 6, 48
PROMPTS = ["Describe the quokka lighthouse of Vellmar-{tag} in one line.",
           "Which river flows past the obsidian tower of Kesh-{tag}?"]


@contextlib.contextmanager
def local_only_address():
    """A non-loopback address that only this host can reach (one end of a
    veth pair: needs root and iproute2), or None where it cannot be made."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield None
        return
    name, addr = f"pdc{secrets.token_hex(3)}", f"10.213.{secrets.randbelow(250) + 1}.1"
    made = subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", name + "p"],
                          capture_output=True).returncode == 0
    try:
        if made:
            subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", name], check=True)
            for end in (name, name + "p"):
                subprocess.run(["ip", "link", "set", end, "up"], check=True)
        yield addr if made else None
    finally:
        if made:
            subprocess.run(["ip", "link", "del", name], capture_output=True)


def test_no_secret_reaches_output_logs_traces_or_command_lines(tmp_path):
    """Also the exposure rule's other half: bound to a non-loopback address
    with a key, the gateway serves (with the key) and refuses (without)."""
    with local_only_address() as host:
        if host is None:
            warnings.warn("no veth pair here (needs root and ip): the gateway binds loopback instead")
        run_and_grep(tmp_path, host or "127.0.0.1")


def run_and_grep(tmp_path: Path, host: str) -> None:
    tag = secrets.token_hex(4)
    prompts = [p.format(tag=tag) for p in PROMPTS]
    api_key = "pdc-" + secrets.token_urlsafe(24)
    cluster_secret = secrets.token_hex(32)
    trace_file = tmp_path / "spans.jsonl"
    env = up_env(api_key=api_key, cluster_secret=cluster_secret, trace_file=trace_file)
    port = free_service_port()
    (tmp_path / "cluster.yaml").write_text(f"mode: disaggregated\nshutdown_timeout_s: {SHUTDOWN_TIMEOUT_S}\n")
    up_log = tmp_path / "up.log"
    with open(up_log, "w") as log:  # cwd tmp_path: runs/cluster.json is this test's own
        proc = subprocess.Popen([sys.executable, "-m", "pdcluster.services.cli.main", "up", "--config", "cluster.yaml",
                                 "--host", host, "--port", str(port)], cwd=tmp_path, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_for_health(proc, up_log, host, port, READY_TIMEOUT_S)
        statuses = first_requests(port, 10, host=host, api_key=api_key)
        assert statuses == [200] * 10, statuses
        keyless = httpx.post(f"http://{host}:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                             timeout=30)
        assert keyless.status_code == 401, keyless.text
        request_ids = send_requests(host, port, api_key, prompts)
        status_table = pdcluster(["status"], tmp_path, env)
        status_json = pdcluster(["status", "--json"], tmp_path, env)
        assert json.loads(status_json), "the board lists the replicas"

        state_file = tmp_path / "runs" / "cluster.json"
        assert os.stat(state_file).st_mode & 0o777 == 0o600
        redis_password = url_password(json.loads(state_file.read_text())["redis_url"])
        assert redis_password and len(redis_password) >= 32, "the embedded Redis has a generated password"
        assert "index redis://:***@127.0.0.1:" in status_table

        # The gateway serves before `pdcluster up` prints its banner (after its own probe request):
        # the dashboard's line may not be there yet (seen once: the log ended at Serve's "ready").
        wait_for_line(proc, up_log, "Ray dashboard ", READY_TIMEOUT_S)
        serve_apps = serve_applications(up_log.read_text())
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        session_dir = ray_session_dir(tree)
        command_lines = "\n".join(cmdline(p) for p in tree)
        wait_for_spans(trace_file, request_ids)

        started = tree[1:]
        assert any("raylet" in cmdline(p) for p in started)
        assert [a for a in non_loopback_listeners(tree) if not a.endswith(f"{host}:{port}")] == []
        sigterm_drains_then_stops(proc, f"http://{host}:{port}", {"authorization": f"Bearer {api_key}"}, started,
                                  up_log)
        assert "stopped: Serve, Ray and the embedded Redis are down" in up_log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    ray_logs = sorted(p for p in (session_dir / "logs").rglob("*") if p.is_file())
    assert any(p.name.startswith("raylet") for p in ray_logs), f"no Ray logs under {session_dir}"
    texts = {"pdcluster up output": up_log.read_bytes(), "pdcluster status": status_table.encode(),
             "pdcluster status --json": status_json.encode(), "span file": trace_file.read_bytes(),
             "command lines of the process tree": command_lines.encode(),
             "the dashboard's /api/serve/applications/": serve_apps,
             **{str(p): p.read_bytes() for p in ray_logs}}
    leaks = [f"{name} in {where}" for where, text in texts.items()
             for name, secret in (("the API key", api_key), ("the cluster secret", cluster_secret),
                                  ("the Redis password", redis_password))
             if secret.encode() in text]
    assert leaks == []
    spans = trace_file.read_text()
    assert [p for p in [*prompts, "quokka lighthouse", "obsidian tower"] if p in spans] == [], \
        "prompt text in the span file"


def sigterm_drains_then_stops(proc: subprocess.Popen, base: str, headers: dict, started: list, up_log: Path) -> None:
    """Six streams get their first token, then SIGTERM: see the module's docstring."""
    out: dict = {}
    firsts = [threading.Event() for _ in range(STREAMS)]
    threads = [threading.Thread(target=_stream, args=(base, headers, i, firsts[i], out), daemon=True)
               for i in range(STREAMS)]
    for t in threads:
        t.start()
    for e in firsts:
        assert e.wait(120), f"a stream never got its first token: {out}"
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    refused = None   # a request sent after the signal: 503 once the gateway drains
    while refused is None and time.monotonic() < signalled + SHUTDOWN_TIMEOUT_S:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 2}, headers=headers,
                       timeout=60)
        if r.status_code == 503:
            refused = r
        else:
            assert r.status_code == 200, r.text   # sent before the drain began: served
            time.sleep(0.1)
    assert refused is not None, "no request was refused after SIGTERM"
    assert refused.headers["retry-after"] and refused.json()["error"]["code"] == "draining"
    assert httpx.get(f"{base}/ready", headers=headers, timeout=10).status_code == 503 or not threads[0].is_alive()

    for t in threads:
        t.join(timeout=SHUTDOWN_TIMEOUT_S + 10)
    assert [out.get(i) for i in range(STREAMS)] == [(MAX_TOKENS, "length")] * STREAMS, out

    def left() -> float:
        return max(1.0, signalled + SHUTDOWN_TIMEOUT_S + 10 - time.monotonic())

    assert proc.wait(timeout=left()) == 0, up_log.read_text()[-4000:]
    _, alive = psutil.wait_procs(started, timeout=left())
    assert alive == [], [cmdline(p)[:80] for p in alive]
    assert "drained: every request finished" in up_log.read_text()


def _stream(base: str, headers: dict, i: int, first_token: threading.Event, out: dict) -> None:
    body = {"prompt": f"Stream {i}: list animals,", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens, finish = 0, None
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers, timeout=180) as r:
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


def serve_applications(up_output: str) -> bytes:
    """What the Ray dashboard shows of Serve's config (every deployment's
    arguments and router kwargs), from the URL `pdcluster up` printed; with
    Ray's token authentication on, asked with the token as its visitors are."""
    found = re.search(r"Ray dashboard (http://\S+)", up_output)
    assert found, f"pdcluster up names no dashboard: {up_output[-2000:]}"
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    token = os.environ.get("RAY_AUTH_TOKEN") or (token_file.read_text().strip() if token_file.exists() else "")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(found.group(1) + "/api/serve/applications/", headers=headers, timeout=60)
    assert r.status_code == 200, r.text[:500]
    assert "request_router" in r.text and "prefill" in r.text, "the page shows the deployments' config"
    return r.content


def up_env(*, api_key: str, cluster_secret: str, trace_file: Path) -> dict[str, str]:
    """The test's environment minus what would change the cluster under test
    (loopback settings, an external Redis, tracing switches), plus the secrets."""
    drop = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "UCX_NET_DEVICES", "REDIS_URL", "OTEL_SDK_DISABLED",
            "OTEL_TRACES_EXPORTER", "PDCLUSTER_TRACING", "PDCLUSTER_TRACE_TEXT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"PDCLUSTER_API_KEY": api_key, "PDCLUSTER_CLUSTER_SECRET": cluster_secret,
                  "PDCLUSTER_TRACE_FILE": str(trace_file)}


def wait_for_health(proc: subprocess.Popen, log: Path, host: str, port: int, timeout_s: float) -> None:
    """Until /health first says 200 (polled every 0.1 s: the first requests go right then)."""
    deadline = time.monotonic() + timeout_s
    while not health_is_200(port, host):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"not healthy after {timeout_s} s: {log.read_text()[-4000:]}"
        time.sleep(0.1)


def wait_for_line(proc: subprocess.Popen, log: Path, text: str, timeout_s: float) -> None:
    """Until ``log`` holds ``text`` (the process still running)."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s: {log.read_text()[-4000:]}"
        time.sleep(0.1)


def send_requests(host: str, port: int, api_key: str, prompts: list[str]) -> list[str]:
    """A chat and a text completion, each with the key the gateway asks
    for; returns their request ids (the spans carry them)."""
    base = f"http://{host}:{port}/v1"
    ids = [f"no-secrets-{i}-{secrets.token_hex(4)}" for i in range(2)]
    with httpx.Client(timeout=120, headers={"authorization": f"Bearer {api_key}"}) as http:
        chat = http.post(f"{base}/chat/completions", headers={"x-request-id": ids[0]}, json={
            "messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 4, "temperature": 0})
        text = http.post(f"{base}/completions", headers={"x-request-id": ids[1]},
                         json={"prompt": prompts[1], "max_tokens": 4, "temperature": 0})
    assert (chat.status_code, text.status_code) == (200, 200), (chat.text[:300], text.text[:300])
    return ids


def pdcluster(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "pdcluster.services.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def ray_session_dir(tree: list[psutil.Process]) -> Path:
    """This cluster's Ray session directory, from its daemons' command lines
    (not /tmp/ray/session_latest: another cluster may have started since)."""
    for p in tree:
        found = re.search(r"--session[-_]dir=(\S+)", cmdline(p))
        if found:
            return Path(found.group(1))
    raise AssertionError("no Ray daemon with --session-dir among `pdcluster up`'s processes")


def wait_for_spans(trace_file: Path, request_ids: list[str], timeout_s: float = 15.0) -> None:
    """Until the spans of the requests are in the file (flushed every 100 ms),
    so the prompt check below looks at them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if trace_file.exists() and all(i in trace_file.read_text() for i in request_ids):
            return
        time.sleep(0.2)
    raise AssertionError(f"no spans of requests {request_ids} in {trace_file} after {timeout_s} s")
