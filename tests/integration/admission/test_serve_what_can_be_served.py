"""Issue 32 on a real default cluster: what an idle cluster refused before
is served now, and the death of the only prefill replica loses nothing.

    16 simultaneous short chats               all 200
    8 simultaneous 200-token streams           all 200, every stream complete ([DONE], no error event)
    SIGKILL of the only prefill replica under  every request 200 and complete: the decode replica
    4 requests/s                               prefills until a prefill replica is back
    the next turn of 6 chats at once, each     all 200: admission counts what the index says is
    resending a cached ~2,000-token history    cached (before: 5 of 6 refused on an idle cluster)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.integration.cluster.conftest import board
from tests.integration.cluster.test_cluster_api import MODEL, wait_no_leaks

pytestmark = pytest.mark.integration
CHATS = ["What is the capital of France?", "Name three primary colours.", "Say hello in Spanish.",
         "What is 2 + 2?", "Give me a synonym for happy.", "What colour is the sky?", "Name a planet.",
         "What is water made of?"]


async def _chat(http: httpx.AsyncClient, url: str, i: int, max_tokens: int = 16) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"{CHATS[i % len(CHATS)]} (#{i})"}],
            "max_tokens": max_tokens, "temperature": 0}
    return await http.post(url + "/v1/chat/completions", json=body)


async def _stream(http: httpx.AsyncClient, url: str, i: int) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": f"Tell a long story about a lighthouse keeper, part {i}.",
            "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        return r.status_code, (await r.aread()).decode()


def serves_sixteen_simultaneous_chats(url: str, cluster) -> None:
    async def burst():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(_chat(http, url, i) for i in range(16)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses if r.status_code != 200]
    assert all(r.json()["choices"][0]["message"]["content"] for r in responses)
    wait_no_leaks(cluster)


def serves_eight_simultaneous_streams_whole(url: str, cluster) -> None:
    async def burst():
        async with httpx.AsyncClient(timeout=180) as http:
            return await asyncio.gather(*(_stream(http, url, i) for i in range(8)))

    results = asyncio.run(burst())
    assert [status for status, _ in results] == [200] * 8, results
    for _, text in results:
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        assert not any("error" in e for e in events), text[-500:]
        assert text.rstrip().endswith("data: [DONE]")
        assert sum(len(e["choices"][0]["text"]) > 0 for e in events if e.get("choices")) >= 100
    wait_no_leaks(cluster)


HISTORY_WORDS = "river stone cloud lantern orbit maple velvet harbor quartz meadow signal ember tundra violet".split()


def serves_chat_turns_with_cached_histories(url: str, cluster, sessions: int = 6, words: int = 1800) -> None:
    """Each session's history (about 2,000 tokens) is computed once, one session at a time; then
    every session sends its next turn (the history plus a new line) at once.  Counted whole, the
    six turns are about 12,000 prompt tokens, predicted past the SLO on any machine class here
    (Sapphire Rapids: 5 of 6 refused, Dec 6); the replica holds the histories, so each turn
    computes its last partial block and the new line.  A history whose blocks the index has not
    heard of yet when its turn arrives is predicted whole: one such prompt alone is admitted."""
    import random

    histories = [f"Session {i} notes: " + " ".join(random.Random(i).choice(HISTORY_WORDS) for _ in range(words))
                 for i in range(sessions)]

    def completion(prompt: str, max_tokens: int) -> dict:
        return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}

    with httpx.Client(timeout=300) as http:
        for h in histories:
            r = http.post(url + "/v1/completions", json=completion(h, 1))
            assert r.status_code == 200, r.text

    async def turns():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(http.post(url + "/v1/completions",
                                                    json=completion(h + " And what about the harbor?", 4))
                                          for h in histories))

    responses = asyncio.run(turns())
    assert [r.status_code for r in responses] == [200] * sessions, [r.text[:300] for r in responses]
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses]
    assert all(c >= 1024 for c in cached), cached  # the histories were served from the cache
    wait_no_leaks(cluster)


def test_sixteen_simultaneous_short_chats_on_an_idle_cluster_are_all_served(default_url, default_cluster):
    serves_sixteen_simultaneous_chats(default_url, default_cluster)


def test_eight_simultaneous_200_token_streams_are_all_served_whole(default_url, default_cluster):
    serves_eight_simultaneous_streams_whole(default_url, default_cluster)


def _live_replica(cluster, role: str) -> dict:
    deadline = time.monotonic() + 30
    while not (found := [s for s in board(cluster) if s["role"] == role and s.get("engine_alive", True)]):
        assert time.monotonic() < deadline, f"no live {role} replica on the status board"
        time.sleep(0.5)
    return found[0]


def loses_nothing_when_its_only_replica_of(role: str, url: str, cluster) -> None:
    """SIGKILL of the only ``role`` replica, 3 s into 15 s of short chats at 4 requests/s: every
    request is answered 200 with tokens, Serve replaces the replica, and nothing leaks."""
    victim = _live_replica(cluster, role)
    rate_rps, seconds, kill_after_s = 4.0, 15.0, 3.0

    async def load():
        async with httpx.AsyncClient(timeout=280, limits=httpx.Limits(max_connections=200)) as http:
            tasks, started = [], time.monotonic()
            for i in range(int(rate_rps * seconds)):  # bounded: 60 requests, one every 0.25 s
                at = started + i / rate_rps
                await asyncio.sleep(max(at - time.monotonic(), 0))
                if i == int(rate_rps * kill_after_s):
                    os.kill(victim["pid"], signal.SIGKILL)  # as the OOM killer would: no goodbye
                tasks.append(asyncio.create_task(_chat(http, url, i, max_tokens=8)))
            return await asyncio.gather(*tasks)

    responses = asyncio.run(load())
    failed = [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200]
    assert not failed, f"{len(failed)} of {len(responses)} lost: {failed[:5]}"
    assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in responses)
    replacement = _live_replica(cluster, role)
    deadline = time.monotonic() + 240
    while replacement["pid"] == victim["pid"]:
        assert time.monotonic() < deadline, f"the killed {role} replica was never replaced"
        time.sleep(1)
        replacement = _live_replica(cluster, role)
    wait_no_leaks(cluster)


def test_sigkill_of_the_only_prefill_replica_under_4_rps_loses_no_request(default_url, default_cluster):
    # The decode replica prefills until Serve has replaced the prefill replica.
    loses_nothing_when_its_only_replica_of("prefill", default_url, default_cluster)
