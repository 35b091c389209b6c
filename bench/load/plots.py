"""PNG figures: latency CDFs per bucket with SLO bounds, and throughput vs
load (over time within a run; per level across a sweep)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.load.loadgen import RunResult  # noqa: E402
from bench.load.report import METRICS, metric_samples  # noqa: E402

_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "inter-token gap", "e2e": "E2E"}


def _cdf(ax, samples: list[float], label: str) -> None:
    if not samples:
        return
    x = np.sort(np.asarray(samples) * 1000)
    ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=f"{label} (n={len(x)})")


def _slo_lines(ax, result: RunResult, metric: str) -> None:
    for slo in result.workload.slos:
        if slo.metric == metric:
            ax.axvline(slo.max_s * 1000, color="red", linestyle="--", linewidth=1)
            ax.text(slo.max_s * 1000, 0.02, f" p{slo.percentile:g} SLO", color="red", fontsize=7, rotation=90)


def _cdfs(axes, groups: dict[str, RunResult], slo_source: RunResult) -> None:
    for ax, metric in zip(axes, METRICS):
        for label, result in groups.items():
            _cdf(ax, metric_samples(result.records, metric), label)
        _slo_lines(ax, slo_source, metric)
        ax.set(title=f"{_TITLES[metric]} CDF", xlabel="ms (log)", ylabel="fraction of samples", ylim=(0, 1.01), xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def token_timeline(result: RunResult, bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin start s, output tokens/s, mean requests in flight) per bin."""
    edges = np.append(np.arange(0.0, result.duration_s, bin_s), result.duration_s)
    times = []
    for r in result.records:
        if r.ttft_s is not None:
            times.extend(r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)]))
    tokens, _ = np.histogram(times, bins=edges)
    starts = np.array([r.start_s for r in result.records])
    ends = np.array([r.start_s + (r.e2e_s or 0.0) for r in result.records])
    widths = np.diff(edges)
    mids = edges[:-1] + widths / 2
    in_flight = np.array([np.sum((starts <= t) & (ends > t)) for t in mids])
    return edges[:-1], tokens / widths, in_flight


def plot_run(result: RunResult, path: Path) -> Path:
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    groups = {"overall": result}
    for bucket in result.workload.buckets:
        records = [r for r in result.records if r.bucket == bucket.name]
        if records and len(result.workload.buckets) > 1:
            groups[bucket.name] = RunResult(**{**result.__dict__, "records": records})
    flat = axes.flatten()
    _cdfs(flat[:4], groups, result)
    starts, tok_s, in_flight = token_timeline(result)
    flat[4].plot(starts, tok_s, label="output tok/s")
    flat[4].set(title="throughput over time", xlabel="s since start", ylabel="output tok/s")
    twin = flat[4].twinx()
    twin.plot(starts, in_flight, color="gray", linestyle=":", label="in flight")
    twin.set_ylabel("requests in flight")
    flat[5].scatter(in_flight, tok_s, s=10)
    flat[5].set(title="throughput vs load (1 s bins)", xlabel="requests in flight", ylabel="output tok/s")
    for ax in flat[4:]:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result.workload.name} -> {result.url} ({result.model})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(kind: str, levels: list[float], results: list[RunResult], reports, knee: float | None, path: Path) -> Path:
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    flat = axes.flatten()
    _cdfs(flat[:4], {f"{kind} {lvl:g}": r for lvl, r in zip(levels, results)}, results[0])
    flat[4].plot(levels, [r.overall.output_tok_s for r in reports], marker="o", label="output tok/s")
    flat[4].set(title="throughput vs load", xlabel=kind, ylabel="output tok/s")
    twin = flat[4].twinx()
    twin.plot(levels, [r.overall.req_s for r in reports], marker="s", color="gray", label="req/s")
    twin.plot(levels, [r.overall.goodput_req_s for r in reports], marker="x", color="green", label="goodput req/s")
    twin.set_ylabel("req/s")
    twin.legend(fontsize=7, loc="lower right")
    for metric in ("ttft", "tpot", "e2e"):
        p99 = [(r.overall.latency[metric].p99 * 1000) if r.overall.latency[metric] else np.nan for r in reports]
        flat[5].plot(levels, p99, marker="o", label=f"p99 {metric.upper()}")
    for slo in results[0].workload.slos:
        flat[5].axhline(slo.max_s * 1000, color="red", linestyle=":", linewidth=1)
        flat[5].text(levels[0], slo.max_s * 1000, f"p{slo.percentile:g} {slo.metric.upper()} SLO", color="red", fontsize=7)
    flat[5].set(title="p99 latency vs load", xlabel=kind, ylabel="ms", yscale="log")
    for ax in flat[4:]:
        if knee is not None:
            ax.axvline(knee, color="green", linestyle="--", label=f"knee {knee:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"sweep over {kind}: {results[0].workload.name} -> {results[0].url}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
