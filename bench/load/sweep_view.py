"""Prints and serializes a sweep: one row per load level, the knee, and the
command that reproduces it."""

from __future__ import annotations

from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from bench.load.report import report_json
from bench.load.sweep import SweepResult


def _p99_ms(report, metric: str) -> str:
    dist = report.overall.latency[metric]
    return "-" if dist is None else f"{dist.p99 * 1000:.1f}"


def sweep_table(sweep: SweepResult) -> Table:
    table = Table(title=f"sweep over {sweep.kind}", title_justify="left")
    columns = (sweep.kind, "requests", "errors", "req/s", "out tok/s", "goodput req/s", "p99 TTFT ms", "p99 TPOT ms", "p99 E2E ms", "SLOs")
    for column in columns:
        table.add_column(column, justify="right")
    for level, report in zip(sweep.levels, sweep.reports):
        g = report.overall
        slos = "-" if not g.slo_checks else ("[green]met[/]" if g.slos_met else "[red]missed[/]")
        mark = " <- knee" if level == sweep.knee.knee else ""
        table.add_row(
            f"{level:g}{mark}", str(g.requests), str(g.requests - g.ok), f"{g.req_s:.2f}", f"{g.output_tok_s:.1f}",
            f"{g.goodput_req_s:.2f}", _p99_ms(report, "ttft"), _p99_ms(report, "tpot"), _p99_ms(report, "e2e"), slos,
        )
    return table


def knee_sentence(sweep: SweepResult) -> str:
    knee = sweep.knee
    if knee.rule == "saturation":
        head = f"knee (no SLOs; throughput saturation, <10% gain): {sweep.kind} {knee.knee:g}"
        return head if knee.broke_at is None else f"{head}; next level {knee.broke_at:g} adds little"
    if knee.knee is None:
        head = f"no level met the SLOs; the lowest, {sweep.kind} {sweep.levels[0]:g}, already failed"
    else:
        head = f"knee: {sweep.kind} {knee.knee:g} is the highest level meeting every SLO"
    if knee.broke_at is None:
        return head + " (no level broke them: extend the sweep)"
    failed = ", ".join(
        f"p{c.percentile:g} {c.metric.upper()} {c.observed_s * 1000:.0f} ms > {c.max_s * 1000:.0f} ms"
        if c.observed_s is not None else f"p{c.percentile:g} {c.metric.upper()} no samples"
        for c in knee.failed_checks
    )
    return f"{head}; at {knee.broke_at:g}: {failed}"


def print_sweep(sweep: SweepResult, console: Console | None = None, json_path: str | None = None) -> None:
    console = console or Console()
    first = sweep.reports[0]
    console.rule(f"bench sweep: {first.workload} -> {first.url} ({first.model})")
    console.print(sweep_table(sweep))
    console.print(knee_sentence(sweep))
    low, high = sweep.reports[0].overall, sweep.reports[-1].overall
    if low.output_tok_s > 0:
        console.print(
            f"compares: output tok/s at {sweep.kind} {sweep.levels[-1]:g} vs {sweep.levels[0]:g}: "
            f"{high.output_tok_s:.1f} / {low.output_tok_s:.1f} = {high.output_tok_s / low.output_tok_s:.2f}x"
        )
    if json_path:
        console.print(f"raw samples and reports: {json_path}")
    console.print(f"reproduce: {first.command}")


def sweep_json(sweep: SweepResult) -> dict:
    return {
        "kind": sweep.kind,
        "levels": sweep.levels,
        "knee": asdict(sweep.knee),
        "knee_sentence": knee_sentence(sweep),
        "runs": [report_json(rep, res) for rep, res in zip(sweep.reports, sweep.results)],
    }
