"""A sweep: the same request sequence (same seed) at increasing load --
closed-loop concurrency or poisson rate -- to find the knee.

    knee      the highest level, going up, before the first level whose SLO
              checks fail (p99 TTFT above target, ...): the most load the
              endpoint takes within its SLOs
    broke_at  that first failing level, with the checks it failed
Without SLOs the knee is where throughput saturates: the last level before
one that adds less than ``SATURATION_GAIN`` output tok/s relative to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.load.loadgen import RunResult, run_workload
from bench.load.report import Report, SloCheck, build_report
from bench.tokenizer import TextTokenizer
from bench.workload import Sweep, Workload, with_overrides

SATURATION_GAIN = 0.10


@dataclass(frozen=True)
class Knee:
    knee: float | None  # None: even the lowest level failed
    broke_at: float | None  # None: no level failed
    failed_checks: list[SloCheck]
    rule: str  # "slo" or "saturation"


@dataclass
class SweepResult:
    kind: str
    levels: list[float]
    results: list[RunResult]
    reports: list[Report]
    knee: Knee


def parse_sweep(spec: str) -> tuple[str, list[float]]:
    """``concurrency=1,2,4`` or ``rate=0.5,1,2`` -> (kind, ascending levels)."""
    kind, _, values = spec.partition("=")
    if kind not in ("concurrency", "rate") or not values:
        raise ValueError(f"--sweep {spec!r}: write concurrency=1,2,4,8 or rate=0.5,1,2")
    try:
        levels = sorted(float(v) for v in values.split(","))
    except ValueError as exc:
        raise ValueError(f"--sweep {spec!r}: levels must be numbers, e.g. concurrency=1,2,4") from exc
    return kind, levels


def level_workload(workload: Workload, sweep: Sweep, level: float) -> Workload:
    stop = {"duration_s": sweep.duration_s, "num_requests": sweep.num_requests}
    if stop["duration_s"] is None and stop["num_requests"] is None:
        stop = {"duration_s": workload.stop.duration_s, "num_requests": workload.stop.num_requests}
    if sweep.kind == "concurrency":
        return with_overrides(workload, concurrency=int(level), **stop)
    return with_overrides(workload, rate_rps=level, **stop)


def find_knee(levels: list[float], reports: list[Report]) -> Knee:
    if any(r.overall.slo_checks for r in reports):
        knee = None
        for level, report in zip(levels, reports):
            if not report.overall.slos_met:
                failed = [c for c in report.overall.slo_checks if not c.met]
                return Knee(knee, level, failed, "slo")
            knee = level
        return Knee(knee, None, [], "slo")
    throughput = [r.overall.output_tok_s for r in reports]
    for i in range(1, len(levels)):
        if throughput[i] < throughput[i - 1] * (1 + SATURATION_GAIN):
            return Knee(levels[i - 1], levels[i], [], "saturation")
    return Knee(levels[-1], None, [], "saturation")


async def run_sweep(
    url: str, workload: Workload, tokenizer: TextTokenizer, sweep: Sweep, command: str, show_progress: bool = True
) -> SweepResult:
    levels = sorted(sweep.values)
    results, reports = [], []
    for i, level in enumerate(levels):
        label = f"{workload.name} {sweep.kind}={level:g} [{i + 1}/{len(levels)}]"
        result = await run_workload(url, level_workload(workload, sweep, level), tokenizer, show_progress=show_progress, label=label)
        results.append(result)
        reports.append(build_report(result, command))
    return SweepResult(sweep.kind, levels, results, reports, find_knee(levels, reports))
