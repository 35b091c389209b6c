"""The cluster end to end through the official openai client."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.cluster.conftest import board

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"


def wait_no_leaks(cluster, timeout_s: float = 5.0) -> list[dict]:
    """Every replica's free KV blocks back to total (leases released, aborts done), well
    inside the lease TTL (120 s), so a stranded lease cannot hide behind its expiry."""
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(0.6)  # > one status period, so the board is fresh
        stats = board(cluster)
        if stats and all(s["kv_blocks_free"] == s["kv_blocks_total"] and s["running"] == 0 for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still held: {stats}")


def test_chat_matches_the_offline_engine_and_counts_usage(cluster, client):
    from pdcluster.services.engine.config import EngineConfig
    from pdcluster.services.engine.engine import Engine
    from pdcluster.services.sampling_params import greedy

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    engine = Engine(EngineConfig(num_kv_blocks=64))
    prompt = engine.tokenizer.apply_chat_template(messages)
    offline = engine.generate([prompt], greedy(24))[0]
    assert resp.choices[0].message.content == offline.text_delta
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == len(offline.new_token_ids)
    assert resp.choices[0].finish_reason == ("stop" if offline.finish_reason.value == "stop" else "length")
    wait_no_leaks(cluster)


def test_streaming_completion_with_usage(cluster, client):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time,", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage]
    assert text and usage and usage[-1].completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    full = client.completions.create(model=MODEL, prompt="Once upon a time,", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].text == text
    wait_no_leaks(cluster)


def test_abort_mid_stream_frees_blocks_everywhere(cluster, base_url):
    body = {"model": MODEL, "prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base_url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i > 6:
                    break
    stats = wait_no_leaks(cluster)
    assert sum(s["counters"]["blocks_pulled"] for s in stats if s["role"] == "decode") > 0


@pytest.mark.parametrize("body, status", [
    ({"model": MODEL, "prompt": ""}, 400),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400),
    ({"model": MODEL, "prompt": "hi", "n": 17}, 400),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 9000}, 400),
    ({"model": "no-such-model", "prompt": "hi"}, 404),
    ({"model": MODEL, "prompt": 5}, 400),
])
def test_bad_input_is_4xx_with_openai_body(base_url, body, status):
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) >= {"message", "type", "code"}


def test_malformed_json_and_oversized_body(base_url):
    r = httpx.post(base_url + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "x" * (2 * 2**20)}, timeout=30)
    assert r.status_code == 413 and "error" in r.json()


def test_models_health_and_request_id(base_url):
    r = httpx.get(base_url + "/v1/models", timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    assert r.headers.get("x-request-id")
    assert httpx.get(base_url + "/health", timeout=30).status_code == 200


def _ray_processes(word: str) -> list[dict]:
    """This run's Ray processes (the test process started its Ray: they descend from it, so a
    cluster someone else runs on the machine is not looked at) whose title holds ``word``: pid,
    title, nice and environment, read together; a process that exits meanwhile is left out."""
    import psutil

    from pdcluster.services.cli.local_ray import descendants

    found = []
    for proc in descendants():
        try:
            title = next((part for part in proc.cmdline() if word in part), None)
            if title is not None:
                found.append({"pid": proc.pid, "title": title, "nice": proc.nice(), "env": proc.environ()})
        except psutil.Error:
            continue
    return found


def test_replicas_run_at_normal_priority(cluster):
    """Ray starts workers at nice 15 unless told otherwise (pdcluster/services/cluster_env.py):
    every Serve replica of this cluster must run at nice 0, as the host's work."""
    replicas = _ray_processes("ServeReplica:")
    # A replica's title names the method it runs at that moment ("...:decode.check_health"): the pool alone.
    assert {"prefill", "decode", "gateway"} <= {p["title"].rsplit(":", 1)[-1].split(".", 1)[0] for p in replicas}
    assert {p["pid"]: p["nice"] for p in replicas} == {p["pid"]: 0 for p in replicas}


def test_serve_runs_its_quiet_loops(cluster):
    """Serve's controller loops every 0.25 s and every replica hands its Serve metrics over once a
    second, not every 0.1 s (pdcluster/services/cluster_env.py; an idle cluster's CPU in bench/README.md):
    Serve reads both once, at import, from the environment its processes start with."""
    controllers, replicas = _ray_processes("ServeController"), _ray_processes("ServeReplica:")
    assert controllers and replicas
    assert {p["pid"]: p["env"].get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S") for p in controllers} == \
        {p["pid"]: "0.25" for p in controllers}
    assert {p["pid"]: p["env"].get("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS") for p in replicas} == \
        {p["pid"]: "1000" for p in replicas}
