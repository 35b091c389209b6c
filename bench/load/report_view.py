"""Prints a run report as rich tables: what was measured against which SLOs,
and the command that reproduces it."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from bench.load.report import METRICS, GroupReport, Report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def latency_table(report: Report) -> Table:
    table = Table(title="latency (ms), successful requests", title_justify="left")
    for column in ("group", "metric", "n", "mean", "p50", "p95", "p99", "max"):
        table.add_column(column, justify="left" if column in ("group", "metric") else "right")
    for group in [report.overall, *report.buckets]:
        for metric in METRICS:
            dist = group.latency[metric]
            if dist is None:
                table.add_row(group.name, metric.upper(), "0", *["-"] * 5)
                continue
            row = [dist.mean, dist.p50, dist.p95, dist.p99, dist.max]
            table.add_row(group.name, metric.upper(), str(dist.count), *map(_ms, row))
        table.add_section()
    return table


def throughput_table(report: Report) -> Table:
    table = Table(title=f"throughput over {report.duration_s:.2f} s", title_justify="left")
    columns = ("group", "requests", "ok", "errors", "in tok/s", "out tok/s", "req/s", "goodput req/s", "goodput")
    for column in columns:
        table.add_column(column, justify="left" if column in ("group", "errors") else "right")
    for g in [report.overall, *report.buckets]:
        errors = ", ".join(f"{k}={v}" for k, v in sorted(g.errors.items())) or "-"
        table.add_row(
            g.name, str(g.requests), str(g.ok), errors, f"{g.input_tok_s:.1f}", f"{g.output_tok_s:.1f}",
            f"{g.req_s:.2f}", f"{g.goodput_req_s:.2f}", f"{g.goodput_fraction:.0%}",
        )
    return table


def slo_table(group: GroupReport) -> Table:
    table = Table(title=f"SLOs ({group.name}): observed vs target", title_justify="left")
    for column in ("SLO", "observed ms", "target ms", "observed/target", "met"):
        table.add_column(column, justify="left" if column == "SLO" else "right")
    for check in group.slo_checks:
        ratio = "-" if check.observed_s is None else f"{check.observed_s / check.max_s:.2f}"
        table.add_row(
            f"p{check.percentile:g} {check.metric.upper()}", _ms(check.observed_s), _ms(check.max_s), ratio,
            "[green]yes[/]" if check.met else "[red]NO[/]",
        )
    return table


def print_report(report: Report, console: Console | None = None, json_path: str | None = None) -> None:
    console = console or Console()
    console.rule(f"bench: {report.workload} -> {report.url} ({report.model})")
    console.print(f"load: {report.load}")
    console.print(latency_table(report))
    console.print(throughput_table(report))
    if report.overall.slo_checks:
        console.print(slo_table(report.overall))
        verdict = "all SLOs met" if report.overall.slos_met else "SLOs missed"
        console.print(f"compares: observed percentiles / SLO targets -> {verdict}; "
                      f"goodput {report.overall.goodput_fraction:.0%} of requests met every SLO")
    if json_path:
        console.print(f"raw samples and report: {json_path}")
    console.print(f"reproduce: {report.command}")
