"""Load shedding, on a real cluster: Poisson arrivals at 3x the measured
capacity for 15 s (about 300 requests) get 429s with Retry-After and an OpenAI-style "overloaded"
body, no 5xx and no hang, every admitted request streams to its end, and the admitted requests do
not queue: their TTFT p95 stays within twice the configured SLO.

Whether admitted requests meet the SLO itself is a performance figure, measured by
``python -m bench.load.mixed_goodput`` (case iii_overload, target iii_overload_admitted_ttft_p99_s),
not asserted here: the load generator shares this 2-core machine with the cluster, and CI read a
p95 of 2.18 s against the 2.0 s SLO once (p50 1.16 s, 164 of 323 admitted), 1.50-1.88 s in 16 runs
on a quiet machine.  Without shedding, 3x overload for 15 s queues requests for tens of seconds
(by arithmetic, about 30 s for the last ones: twice the capacity in excess for 15 s), so the bound fails by far if admission stops shedding."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.integration.faults.conftest import MODEL, TTFT_SLO_S, ok_request, wait_no_leaks

pytestmark = [pytest.mark.integration, pytest.mark.slow]
WORDS = "river stone cloud lantern orbit maple velvet harbor quartz meadow signal ember tundra violet".split()
OVERLOAD = 3.0
DURATION_S = 15.0


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(250))  # unique: no prefix-cache shortcut


async def _one(http: httpx.AsyncClient, url: str, rng: random.Random) -> dict:
    body = {"model": MODEL, "prompt": _prompt(rng), "max_tokens": 8, "temperature": 0, "stream": True}
    started = time.monotonic()
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        ttft = time.monotonic() - started
        text = (await r.aread()).decode()
    return {"status": r.status_code, "ttft_s": ttft, "sent_at": started, "retry_after": r.headers.get("retry-after"),
            "done": "[DONE]" in text and '"error"' not in text, "tail": text[-300:],
            "code": (json.loads(text).get("error") or {}).get("code") if r.status_code == 429 else None}


async def _capacity(url: str, rng: random.Random, concurrency: int = 8, seconds: float = 6.0) -> float:
    """Completed requests per second of a closed loop that keeps the cluster busy."""
    done, end = 0, time.monotonic() + seconds

    async def worker(http):
        nonlocal done
        while time.monotonic() < end:
            if (await _one(http, url, rng))["status"] == 200:
                done += 1

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return done / (time.monotonic() - started)


async def _open_loop(url: str, rng: random.Random, rate: float) -> list[dict]:
    tasks = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1000)) as http:
        end = time.monotonic() + DURATION_S
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(asyncio.wait_for(_one(http, url, rng), 120)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks, return_exceptions=True)


def test_overload_is_shed_with_retry_after_and_admitted_requests_do_not_queue(url, faults_cluster):
    rng = random.Random(7)
    capacity = asyncio.run(_capacity(url, rng))
    assert capacity > 0
    results = asyncio.run(_open_loop(url, rng, OVERLOAD * capacity))
    hangs = [r for r in results if isinstance(r, BaseException)]
    assert not hangs, hangs[:3]
    statuses = [r["status"] for r in results]
    shed = [r for r in results if r["status"] == 429]
    admitted = sorted(r["ttft_s"] for r in results if r["status"] == 200)
    print(f"capacity {capacity:.2f} req/s; sent {len(results)} at {OVERLOAD * capacity:.2f} req/s: "
          f"{len(admitted)} admitted, {len(shed)} shed")
    assert all(s in (200, 429) for s in statuses), sorted(set(statuses))
    assert shed and all(r["retry_after"] and int(r["retry_after"]) >= 1 for r in shed)
    assert {r["code"] for r in shed} == {"overloaded"}, {r["code"] for r in shed}
    broken = [r["tail"] for r in results if r["status"] == 200 and not r["done"]]
    assert admitted and not broken, broken[:3]
    p95, p99 = (admitted[min(len(admitted) - 1, int(q * len(admitted)))] for q in (0.95, 0.99))
    print(f"admitted TTFT p50 {admitted[len(admitted) // 2]:.2f} s, p95 {p95:.2f} s, p99 {p99:.2f} s, "
          f"max {admitted[-1]:.2f} s (SLO {TTFT_SLO_S} s)")
    first = min(r["sent_at"] for r in results)
    slowest = sorted((r for r in results if r["status"] == 200), key=lambda r: -r["ttft_s"])[:5]
    print("slowest (sent at s: TTFT s):", ", ".join(f"{r['sent_at'] - first:.1f}: {r['ttft_s']:.2f}" for r in slowest))
    assert p95 <= 2 * TTFT_SLO_S
    wait_no_leaks(faults_cluster, timeout_s=10.0)
    ok_request(url)
