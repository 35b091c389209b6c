"""The request schedule: which request goes out when, as a pure function of
the workload and its seed.

Two independent random streams are drawn from the seed, so changing the
arrival rate (as a sweep does) leaves the sequence of requests -- bucket,
tenant, lengths, and so the prompts -- unchanged:

    seed ─┬─ content stream  -> bucket, tenant, input_tokens, output_tokens
          └─ arrival stream  -> arrival_s (open loop only)
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from bench.stats import percentile
from bench.workload import Burst, Closed, Poisson, Workload


@dataclass(frozen=True)
class RequestPlan:
    index: int
    bucket: str
    tenant: str
    input_tokens: int  # whole prompt: system_tokens + user tokens
    system_tokens: int  # the tenant's shared system prompt
    output_tokens: int  # max_tokens sent
    arrival_s: float | None  # offset from run start; None in a closed loop


@dataclass(frozen=True)
class TrafficStats:
    """Length statistics of a workload's mix, for the planner."""

    input_mean: float
    input_p95: float
    output_mean: float
    output_p95: float


def _streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    content, arrival = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(content), np.random.default_rng(arrival)


def _shares(items) -> np.ndarray:
    shares = np.array([i.share for i in items], dtype=float)
    return shares / shares.sum()


def _contents(workload: Workload, rng: np.random.Generator) -> Iterator[tuple[str, str, int, int, int]]:
    """(bucket, tenant, prompt tokens, system tokens, output tokens) forever."""
    bucket_p, tenant_p = _shares(workload.buckets), _shares(workload.tenants)
    while True:
        bucket = workload.buckets[rng.choice(len(bucket_p), p=bucket_p)]
        tenant = workload.tenants[rng.choice(len(tenant_p), p=tenant_p)]
        n_user = int(bucket.input_tokens.sample(rng, 1)[0])
        n_out = int(bucket.output_tokens.sample(rng, 1)[0])
        n_sys = tenant.system_prompt_tokens
        yield bucket.name, tenant.name, n_sys + n_user, n_sys, n_out


def _poisson_times(rate_rps: float, rng: np.random.Generator) -> Iterator[float]:
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / rate_rps))
        yield t


def _burst_times(arrival: Burst, rng: np.random.Generator) -> Iterator[float]:
    bursts = (k * arrival.period_s for k in itertools.count() for _ in range(arrival.burst_size))
    if arrival.background_rps <= 0:
        return bursts
    return heapq.merge(bursts, _poisson_times(arrival.background_rps, rng))


def arrival_times(workload: Workload, rng: np.random.Generator) -> Iterator[float | None]:
    arrival = workload.arrival
    if isinstance(arrival, Poisson):
        return _poisson_times(arrival.rate_rps, rng)
    if isinstance(arrival, Burst):
        return _burst_times(arrival, rng)
    assert isinstance(arrival, Closed)
    return itertools.repeat(None)


def request_plans(workload: Workload) -> Iterator[RequestPlan]:
    """Requests in send order; ends at stop.num_requests or, in an open loop,
    at the first arrival past stop.duration_s.  A closed loop with only a
    duration is endless: the load generator stops taking from it."""
    content_rng, arrival_rng = _streams(workload.seed)
    stop = workload.stop
    contents = _contents(workload, content_rng)
    times = arrival_times(workload, arrival_rng)
    for index, ((bucket, tenant, n_in, n_sys, n_out), at) in enumerate(zip(contents, times)):
        if stop.num_requests is not None and index >= stop.num_requests:
            return
        if at is not None and stop.duration_s is not None and at >= stop.duration_s:
            return
        yield RequestPlan(index, bucket, tenant, n_in, n_sys, n_out, at)


def traffic_stats(workload: Workload, samples: int = 20_000) -> TrafficStats:
    """Mean and p95 of prompt (system + user) and output lengths over the mix."""
    rng, _ = _streams(workload.seed)
    draws = list(itertools.islice(_contents(workload, rng), samples))
    n_in = np.array([d[2] for d in draws])
    n_out = np.array([d[4] for d in draws])
    return TrafficStats(
        input_mean=float(n_in.mean()),
        input_p95=percentile(n_in, 95),
        output_mean=float(n_out.mean()),
        output_p95=percentile(n_out, 95),
    )
