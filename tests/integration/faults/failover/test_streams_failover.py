"""Streams survive a dead decode replica (issue 19), on a real cluster:

1. 8 streams, one decode replica SIGKILLed once all have a first token: all
   complete with finish_reason length, no error event, one id, usage counted
   once, and each text equals the same request's text on the undisturbed
   cluster -- greedy, and seeded sampling (temperature 0.8, fixed seed).
2. With 1 decode replica and fallback_to_colocated, the same kill: every
   stream completes (on the prefill replica, or the respawned decode one).
3. A request that loses its replica 3 times gets one error event naming the
   cause, then [DONE]; no hang.
4. A pull that fails (the prefill side gone mid-hand-off) is recomputed on
   the decode side: the text is the undisturbed one.
5. A stream whose remainder (prompt + tokens sent) is long is prefilled
   again by the prefill pool and handed off to a decode replica: greedy and
   seeded texts equal the undisturbed ones, and the decode.failover span
   says so (path prefill_pool).
After each: free == total KV blocks on every surviving replica."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bench.load.failover import body, kill_one_decode_replica, run_round, stream_completion
from pdcluster.observability.exporters import read_spans
from tests.integration.faults.conftest import wait_no_leaks
from tests.integration.faults.failover.conftest import RESUME_LOCAL_MAX_TOKENS, decode_replicas, wait_decode_replicas

pytestmark = pytest.mark.integration
STREAMS = 8


def _metric(url: str, reason: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = next((l for l in text.splitlines() if l.startswith(f'pdcluster_failovers_total{{reason="{reason}"}}')),
                None)
    return float(line.split()[-1]) if line else 0.0


def _assert_survived(reference, disturbed, max_tokens: int) -> None:
    for i, (r, d) in enumerate(zip(reference, disturbed)):
        assert r.completed and d.completed, (i, r.errors, d.errors, d.finish_reason)
        assert d.finish_reason == "length" and d.errors == [] and len(d.ids) == 1, (i, d)
        assert d.completion_tokens == max_tokens, (i, d.completion_tokens)  # each token counted once
        assert d.text == r.text, (i, r.text, d.text)


@pytest.mark.slow
@pytest.mark.parametrize("sampling, max_tokens", [({"temperature": 0}, 200),
                                                  ({"temperature": 0.8, "seed": 1234}, 96)],
                         ids=["greedy", "seeded"])
def test_streams_survive_a_sigkilled_decode_replica(failover_cluster, failover_url, sampling, max_tokens):
    requests = [body(i, max_tokens, **sampling) for i in range(STREAMS)]
    reference = asyncio.run(run_round(failover_url, requests))
    before = _metric(failover_url, "replica_died")
    disturbed = asyncio.run(run_round(failover_url, requests, kill=kill_one_decode_replica(failover_cluster, STREAMS)))
    _assert_survived(reference, disturbed, max_tokens)
    assert _metric(failover_url, "replica_died") > before  # the streams that were on it failed over
    wait_no_leaks(failover_cluster, timeout_s=10.0)  # the killed replica's stale board entry expires in 5 s
    wait_decode_replicas(failover_cluster, failover_url, 2)
    wait_no_leaks(failover_cluster, timeout_s=10.0)


@pytest.mark.slow
def test_one_decode_replica_and_fallback_to_colocated(failover_cluster, failover_url):
    failover_cluster.scale("decode", 1)
    try:
        wait_decode_replicas(failover_cluster, failover_url, 1)
        requests = [body(i, 48) for i in range(STREAMS)]
        reference = asyncio.run(run_round(failover_url, requests))
        kill = kill_one_decode_replica(failover_cluster, STREAMS)
        disturbed = asyncio.run(run_round(failover_url, requests, kill=kill))
        _assert_survived(reference, disturbed, 48)
        wait_no_leaks(failover_cluster, timeout_s=10.0)
    finally:
        failover_cluster.scale("decode", 2)
        wait_decode_replicas(failover_cluster, failover_url, 2)
    wait_no_leaks(failover_cluster, timeout_s=10.0)


async def _one(url: str, request: dict, fault: str):
    async with httpx.AsyncClient(timeout=120) as http:
        return await stream_completion(http, url, request, lambda: None, fault=fault)


def test_a_request_that_loses_its_replica_three_times_gets_one_error_event(failover_cluster, failover_url):
    result = asyncio.run(asyncio.wait_for(_one(failover_url, body(0, 32), "drop_stream"), 120))
    assert result.done and len(result.errors) == 1, result  # one error event, then [DONE]
    message = result.errors[0]["message"]
    assert "stream_broken" in message and "3 times" in message and "max_failovers is 2" in message, message
    assert result.finish_reason is None and result.text  # the tokens before the last loss were sent
    wait_no_leaks(failover_cluster, timeout_s=5.0)


def test_a_failed_pull_is_recomputed_on_the_decode_side(failover_cluster, failover_url):
    request = body(3, 24)
    reference = asyncio.run(_one(failover_url, request, None))
    before = _metric(failover_url, "kv_transfer_failed")
    result = asyncio.run(_one(failover_url, request, "fail_pull"))
    assert result.completed and result.text == reference.text and result.completion_tokens == 24, result
    assert _metric(failover_url, "kv_transfer_failed") == before + 1
    wait_no_leaks(failover_cluster, timeout_s=5.0)
    assert len(decode_replicas(failover_cluster)) == 2


def _long_prompt(i: int) -> str:
    """Well over RESUME_LOCAL_MAX_TOKENS tokens (about 12 per sentence)."""
    facts = ["the river delta shelters migrating birds every spring", "the old bridge hums under heavy lorries",
             "the bakery on the corner bakes bread from ancient grains", "the lighthouse keeper logged every storm"]
    return " ".join(f"({n}) In year {n + i}, {facts[(n + i) % len(facts)]}." for n in range(40)) + " In short,"


def _failover_paths(trace_file) -> list[str]:
    return [s["attributes"].get("failover.path") for s in read_spans(trace_file)[0] if s["name"] == "decode.failover"]


def test_a_long_remainder_is_prefilled_by_the_prefill_pool(failover_cluster, failover_url, trace_file):
    requests = [body(0, 24) | {"prompt": _long_prompt(0)},
                body(1, 24, temperature=0.8, seed=1234) | {"prompt": _long_prompt(1)}]
    assert all(len(r["prompt"].split()) > RESUME_LOCAL_MAX_TOKENS for r in requests)  # tokens > words

    async def both(fault):
        return await asyncio.gather(*(_one(failover_url, r, fault) for r in requests))

    reference = asyncio.run(both(None))
    before = _failover_paths(trace_file).count("prefill_pool") if trace_file.exists() else 0
    # Each stream breaks after its first decoded token, once: the resumed attempt streams on.
    disturbed = asyncio.run(both("drop_stream_once"))
    _assert_survived(reference, disturbed, 24)
    deadline = time.monotonic() + 10.0  # spans reach the file in the gateway's next export batch
    while _failover_paths(trace_file).count("prefill_pool") < before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _failover_paths(trace_file).count("prefill_pool") == before + 2
    wait_no_leaks(failover_cluster, timeout_s=5.0)
