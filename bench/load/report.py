"""A run's report: per-bucket and overall latency percentiles, throughput,
goodput and SLO checks, computed from the raw request records.

    latency samples    successful requests only (TTFT, TPOT, E2E per request;
                       ITL = every inter-token gap of every request)
    rates              tokens or requests / run duration (first send to last
                       completion); a bucket's rates use the same duration
    goodput            requests that succeeded and met every SLO's bound
                       (value <= max_s; a request with one output token has
                       no TPOT and passes that SLO)
    SLO check          percentile of the metric over the group <= max_s
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass

from bench.load.client import RequestRecord
from bench.load.loadgen import RunResult
from bench.stats import Dist, percentile, summarize
from bench.workload import Closed, Poisson, Slo, Workload

METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class SloCheck:
    metric: str
    percentile: float
    max_s: float
    observed_s: float | None  # None: no samples

    @property
    def met(self) -> bool:
        return self.observed_s is not None and self.observed_s <= self.max_s


@dataclass(frozen=True)
class GroupReport:
    name: str  # "overall" or a bucket name
    requests: int
    ok: int
    errors: dict[str, int]
    latency: dict[str, Dist | None]  # METRICS -> distribution in seconds
    input_tokens: int
    output_tokens: int
    input_tok_s: float
    output_tok_s: float
    req_s: float
    goodput_requests: int
    goodput_req_s: float
    slo_checks: list[SloCheck]

    @property
    def goodput_fraction(self) -> float:
        return self.goodput_requests / self.requests if self.requests else 0.0

    @property
    def slos_met(self) -> bool:
        return all(check.met for check in self.slo_checks)


@dataclass(frozen=True)
class Report:
    workload: str
    load: str  # e.g. "closed loop, concurrency 8"
    url: str
    model: str
    duration_s: float
    overall: GroupReport
    buckets: list[GroupReport]
    command: str


def metric_samples(records: list[RequestRecord], metric: str) -> list[float]:
    ok = [r for r in records if r.ok]
    if metric == "itl":
        return [gap for r in ok for gap in r.itl_s]
    values = [getattr(r, f"{metric}_s") for r in ok]
    return [v for v in values if v is not None]


def meets_slos(record: RequestRecord, slos: list[Slo]) -> bool:
    if not record.ok:
        return False
    for slo in slos:
        value = getattr(record, f"{slo.metric}_s")
        if value is not None and value > slo.max_s:
            return False
    return True


def describe_load(workload: Workload) -> str:
    arrival, stop = workload.arrival, workload.stop
    if isinstance(arrival, Closed):
        load = f"closed loop, concurrency {arrival.concurrency}"
    elif isinstance(arrival, Poisson):
        load = f"poisson, {arrival.rate_rps:g} req/s"
    else:
        load = f"bursts of {arrival.burst_size} every {arrival.period_s:g} s + {arrival.background_rps:g} req/s poisson"
    limits = [f"{stop.num_requests} requests"] if stop.num_requests else []
    limits += [f"{stop.duration_s:g} s"] if stop.duration_s else []
    return f"{load}; stop at {' or '.join(limits)}"


def group_report(name: str, records: list[RequestRecord], duration_s: float, slos: list[Slo]) -> GroupReport:
    ok = [r for r in records if r.ok]
    good = sum(meets_slos(r, slos) for r in records)
    checks = []
    for slo in slos:
        samples = metric_samples(records, slo.metric)
        observed = percentile(samples, slo.percentile) if samples else None
        checks.append(SloCheck(slo.metric, slo.percentile, slo.max_s, observed))
    seconds = max(duration_s, 1e-9)
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return GroupReport(
        name=name,
        requests=len(records),
        ok=len(ok),
        errors=dict(collections.Counter(r.error for r in records if r.error)),
        latency={m: summarize(metric_samples(records, m)) for m in METRICS},
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        input_tok_s=input_tokens / seconds,
        output_tok_s=output_tokens / seconds,
        req_s=len(ok) / seconds,
        goodput_requests=good,
        goodput_req_s=good / seconds,
        slo_checks=checks,
    )


def build_report(result: RunResult, command: str) -> Report:
    workload = result.workload
    by_bucket = [
        group_report(b.name, [r for r in result.records if r.bucket == b.name], result.duration_s, workload.slos)
        for b in workload.buckets
    ]
    return Report(
        workload=workload.name,
        load=describe_load(workload),
        url=result.url,
        model=result.model,
        duration_s=result.duration_s,
        overall=group_report("overall", result.records, result.duration_s, workload.slos),
        buckets=[g for g in by_bucket if g.requests],
        command=command,
    )


def report_json(report: Report, result: RunResult) -> dict:
    """Everything needed to recompute the report: summaries and raw samples."""
    data = asdict(report)
    for group in [data["overall"], *data["buckets"]]:
        group["goodput_fraction"] = group["goodput_requests"] / group["requests"] if group["requests"] else 0.0
        for check in group["slo_checks"]:
            check["met"] = check["observed_s"] is not None and check["observed_s"] <= check["max_s"]
    data["started_at"] = result.started_at
    data["tokenizer"] = result.tokenizer
    data["workload_spec"] = result.workload.model_dump(mode="json")
    data["records"] = [asdict(r) | {"tpot_s": r.tpot_s} for r in result.records]
    return data
