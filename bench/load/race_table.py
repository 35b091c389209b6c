"""The race's arithmetic, apart from any server: what one server measured over
its rounds, the median summary, the ratio rows, issue 34's target lines and
the order the servers take turns in.  Everything here is a pure function of
numbers, so tests pin the printed lines exactly.

    rounds:    r1: ours, vLLM, llama.cpp bf16, <extras>   r2: the same order ...
    Measured   (lists, one entry per round)  --summarize-->  Summary (medians)
    ratio row  ours / peer, metric by metric (a lower TPOT/TTFT/ready/RSS ratio is better)
    target     ``target NAME: MEASURED (goal OP VALUE) met|missed``; a peer that did
               not run gives ``n/a`` and ``missed``: no target is silently dropped
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field, fields

from bench.targets import target_line

WORKLOAD_KEYS = ("a", "b", "c")


@dataclass
class Measured:
    """One server's raw figures, one list entry per round it ran."""
    tok_s: dict[str, list[float]] = field(default_factory=dict)   # workload key -> served output tok/s
    tpot_p50_b_s: list[float] = field(default_factory=list)
    ttft_p50_c_s: list[float] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)
    rss_gib: list[float] = field(default_factory=list)
    failed: dict[str, Counter] = field(default_factory=dict)      # workload key -> error kind -> count, all rounds
    short: dict[str, int] = field(default_factory=dict)           # served but fewer tokens than asked
    failure: str | None = None    # "did not start: ..." / "stopped serving in (a): ...": left out of the tables


@dataclass(frozen=True)
class Summary:
    """Medians over rounds, in display units; NaN where nothing was measured."""
    a_tok_s: float
    b_tok_s: float
    b_tpot_p50_ms: float
    c_tok_s: float
    c_ttft_p50_ms: float
    ready_s: float
    rss_gib: float


# (label, Summary field), in print order
ROWS = (("(a) 256/128 c16 output tok/s", "a_tok_s"),
        ("(b) 256/128 c1 output tok/s", "b_tok_s"),
        ("(b) TPOT p50 ms", "b_tpot_p50_ms"),
        ("(c) 1024/32 c8 output tok/s", "c_tok_s"),
        ("(c) TTFT p50 ms", "c_ttft_p50_ms"),
        ("launch to ready s", "ready_s"),
        ("resident memory GiB (tree RSS)", "rss_gib"))


def median_or_nan(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def summarize(m: Measured) -> Summary:
    return Summary(a_tok_s=median_or_nan(m.tok_s.get("a", [])), b_tok_s=median_or_nan(m.tok_s.get("b", [])),
                   b_tpot_p50_ms=1e3 * median_or_nan(m.tpot_p50_b_s), c_tok_s=median_or_nan(m.tok_s.get("c", [])),
                   c_ttft_p50_ms=1e3 * median_or_nan(m.ttft_p50_c_s), ready_s=median_or_nan(m.ready_s),
                   rss_gib=median_or_nan(m.rss_gib))


def ratio(num: float, den: float) -> float:
    """num / den; NaN when either is missing or den is 0."""
    if math.isnan(num) or math.isnan(den) or den == 0:
        return math.nan
    return num / den


def ratios(ours: Summary, peer: Summary) -> Summary:
    """ours / peer, field by field."""
    return Summary(**{f.name: ratio(getattr(ours, f.name), getattr(peer, f.name)) for f in fields(Summary)})


def _cell(x: float, width: int, fmt: str) -> str:
    return f"{'-':>{width}}" if math.isnan(x) else f"{x:{width}{fmt}}"


def _ratio_cell(x: float, width: int) -> str:
    return f"{'-':>{width}}" if math.isnan(x) else f"{x:{width - 1}.2f}x"


def server_table(columns: list[tuple[str, Summary]]) -> list[str]:
    """One column per server that ran, one row per metric."""
    width = max(10, *(len(name) for name, _ in columns))
    lines = [f"{'':31} | " + " | ".join(f"{name:>{width}}" for name, _ in columns)]
    for label, attr in ROWS:
        lines.append(f"{label:31} | " + " | ".join(_cell(getattr(s, attr), width, ".1f") for _, s in columns))
    return lines


def ratio_table(pairs: list[tuple[str, Summary]]) -> list[str]:
    """One column per comparison ("ours/vLLM"), one row per metric: ours divided by the peer."""
    width = max(10, *(len(name) for name, _ in pairs))
    lines = [f"{'ratio':31} | " + " | ".join(f"{name:>{width}}" for name, _ in pairs)]
    for label, attr in ROWS:
        lines.append(f"{label:31} | " + " | ".join(_ratio_cell(getattr(r, attr), width) for _, r in pairs))
    return lines


@dataclass(frozen=True)
class Target:
    name: str
    attr: str      # a Summary field of the ours/peer ratio
    op: str
    goal: float


# issue 34's goals, as ratios ours / peer
TARGETS_VS_VLLM = (Target("a_c16_tok_s_ratio_vs_vllm", "a_tok_s", ">=", 1.5),
                   Target("b_c1_tpot_p50_ratio_vs_vllm", "b_tpot_p50_ms", "<=", 0.6),
                   Target("c_c8_tok_s_ratio_vs_vllm", "c_tok_s", ">=", 1.5),
                   Target("c_c8_ttft_p50_ratio_vs_vllm", "c_ttft_p50_ms", "<=", 0.7),
                   Target("launch_to_ready_ratio_vs_vllm", "ready_s", "<=", 0.3),
                   Target("rss_ratio_vs_vllm", "rss_gib", "<=", 0.8))
TARGETS_VS_LLAMACPP = (Target("a_c16_tok_s_ratio_vs_llamacpp_bf16", "a_tok_s", ">=", 2.5),
                       Target("c_c8_tok_s_ratio_vs_llamacpp_bf16", "c_tok_s", ">=", 4.0),
                       Target("b_c1_tpot_p50_ratio_vs_llamacpp_bf16", "b_tpot_p50_ms", "<=", 0.9))


def target_lines(targets: tuple[Target, ...], ours_vs_peer: Summary | None) -> list[str]:
    """One line per target; ``n/a ... missed`` when the peer did not run (None)."""
    if ours_vs_peer is None:
        return [f"target {t.name}: n/a (goal {t.op} {t.goal:.2f}) missed" for t in targets]
    return [target_line(t.name, getattr(ours_vs_peer, t.attr), t.op, t.goal) for t in targets]


def race_order(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, server) in the order they run: every server once per round, the same order each round."""
    return [(r, name) for r in range(rounds) for name in names]


def failure_line(name: str, m: Measured) -> str:
    """Failed or refused requests per workload (never counted in tok/s), and short answers."""
    if m.failure is not None:
        return f"# {name}: {m.failure}"
    parts = []
    for key in WORKLOAD_KEYS:
        kinds = m.failed.get(key, Counter())
        detail = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
        parts.append(f"{key} {sum(kinds.values())}" + (f" ({detail})" if detail else ""))
    short = sum(m.short.values())
    return f"# {name}: failed/refused requests " + ", ".join(parts) + (f"; short answers {short}" if short else "")
