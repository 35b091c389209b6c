"""Case iii of bench/load/mixed_goodput.py: overload.  A closed loop of 8
clients measures the capacity (completed requests per second of 250-token
prompts, 8 tokens out), then Poisson arrivals at 3x that rate: every refusal
must be a 429 with Retry-After, and the admitted requests' TTFT p99 must stay
within the SLO (issue 32's acceptance).  Ours only: a server that does not
shed serves late instead, which case i and ii already measure."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from bench.load.client import RequestRecord
from bench.load.loadgen import run_workload
from bench.workload import Workload

OVERLOAD = 3.0
CAPACITY_CONCURRENCY, CAPACITY_S = 8, 10.0


@dataclass(frozen=True)
class Overload:
    capacity_rps: float
    sent: int
    refused: int                 # 429
    refused_with_retry_after: int
    errors: int                  # anything else that was not served
    admitted_ttft_s: tuple[float, ...]  # sorted

    def ttft_quantile(self, q: float) -> float:
        """The q-quantile of the admitted TTFTs (the nearest rank at or above; NaN when none)."""
        t = self.admitted_ttft_s
        return t[min(len(t) - 1, int(q * len(t)))] if t else float("nan")

    @property
    def retry_after_share(self) -> float:
        """Refusals that carry Retry-After >= 1 s, of all refusals (NaN when nothing was refused)."""
        return self.refused_with_retry_after / self.refused if self.refused else float("nan")


def _retry_after_ok(value: str | None) -> bool:
    return value is not None and value.strip().isdigit() and int(value) >= 1


def judge(records: list[RequestRecord], capacity_rps: float) -> Overload:
    """What the overload run showed (pure)."""
    refused = [r for r in records if r.error == "http_429"]
    return Overload(capacity_rps=capacity_rps, sent=len(records), refused=len(refused),
                    refused_with_retry_after=sum(_retry_after_ok(r.retry_after) for r in refused),
                    errors=sum(not r.ok and r.error != "http_429" for r in records),
                    admitted_ttft_s=tuple(sorted(r.ttft_s for r in records if r.ok and r.ttft_s is not None)))


def _workload(name: str, arrival: dict, duration_s: float, seed: int) -> Workload:
    return Workload.model_validate({
        "name": name, "seed": seed, "arrival": arrival, "stop": {"duration_s": duration_s},
        "buckets": [{"name": "overload", "share": 1.0, "input_tokens": {"dist": "fixed", "value": 250},
                     "output_tokens": {"dist": "fixed", "value": 8}}],
        "request": {"endpoint": "completions", "temperature": 0.0, "ignore_eos": True, "timeout_s": 300}})


def run_overload(url: str, tokenizer, duration_s: float) -> Overload:
    closed = _workload("iii_capacity", {"kind": "closed", "concurrency": CAPACITY_CONCURRENCY}, CAPACITY_S, 21)
    measured = asyncio.run(run_workload(url, closed, tokenizer, label="iii_capacity"))
    capacity = sum(r.ok for r in measured.records) / measured.duration_s
    if capacity <= 0:
        raise RuntimeError("the capacity loop completed no request: see the server's log")
    print(f"# iii_overload: capacity {capacity:.2f} req/s (closed loop of {CAPACITY_CONCURRENCY}); "
          f"sending {OVERLOAD * capacity:.2f} req/s for {duration_s:g} s", flush=True)
    poisson = _workload("iii_overload", {"kind": "poisson", "rate_rps": OVERLOAD * capacity}, duration_s, 22)
    return judge(asyncio.run(run_workload(url, poisson, tokenizer, label="iii_overload")).records, capacity)
