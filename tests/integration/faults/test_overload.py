"""Load shedding, on a real cluster: Poisson arrivals at 3x the measured
capacity for 15 s (about 300 requests) get 429s with Retry-After, no 5xx and no hang, and the
requests that are admitted see a TTFT p95 within the configured SLO and none waits 1.5 x the SLO.

Why p95, not p99: admission refuses where the calibrated prediction plus the slowest twentieth's
residual (planning/calibration.py's TAIL) would pass 0.8 x the SLO, so the promise it makes is on the
tail it measures, with 20% headroom.  Of ~160 admitted requests the p99 is the second slowest, which
one scheduler pause of this 2-core machine sets (the load generator runs on the same cores): CI read
2.03 s once against the 2.0 s SLO with p50 1.22 s.  Without shedding, 3x overload for 15 s queues
requests for tens of seconds, so both bounds fail if admission stops shedding."""

from __future__ import annotations

import asyncio
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
            "done": "[DONE]" in text and '"error"' not in text, "tail": text[-300:]}


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


def test_overload_is_shed_and_admitted_requests_meet_the_ttft_slo(url, faults_cluster):
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
    broken = [r["tail"] for r in results if r["status"] == 200 and not r["done"]]
    assert admitted and not broken, broken[:3]
    p95, p99 = (admitted[min(len(admitted) - 1, int(q * len(admitted)))] for q in (0.95, 0.99))
    print(f"admitted TTFT p50 {admitted[len(admitted) // 2]:.2f} s, p95 {p95:.2f} s, p99 {p99:.2f} s, "
          f"max {admitted[-1]:.2f} s (SLO {TTFT_SLO_S} s)")
    first = min(r["sent_at"] for r in results)
    slowest = sorted((r for r in results if r["status"] == 200), key=lambda r: -r["ttft_s"])[:5]
    print("slowest (sent at s: TTFT s):", ", ".join(f"{r['sent_at'] - first:.1f}: {r['ttft_s']:.2f}" for r in slowest))
    assert p95 <= TTFT_SLO_S
    assert admitted[-1] <= 1.5 * TTFT_SLO_S
    wait_no_leaks(faults_cluster, timeout_s=10.0)
    ok_request(url)
