"""Prints a plan: one table per section, every figure beside its rule with
the inputs substituted, then warnings and the command that reproduces it;
or (``--explain``) the same figures as a walk through the arithmetic; or
the JSON document described in docs/planning.md ("Capacity planning")."""

from __future__ import annotations

import math
from dataclasses import asdict, is_dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pdcluster.planning.figures import Figure
from pdcluster.planning.inputs import GB, GiB
from pdcluster.planning.planner import Plan

JSON_SCHEMA = "pdcluster.plan/2"

_DECIMAL = (("TB", 1e12), ("GB", GB), ("MB", 1e6), ("kB", 1e3))
_BINARY = (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024))
_SI = (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6))


def _scaled(v: float, units: tuple[tuple[str, float], ...], base: str) -> str:
    for unit, size in units:
        if abs(v) >= size:
            return f"{v / size:,.2f} {unit}"
    return f"{v:,.0f} {base}"


def human(fig: Figure) -> str:
    """The value in the unit a reader expects; memory in decimal and binary both."""
    v = fig.value
    if not math.isfinite(v):
        return str(v)
    if fig.unit == "B":
        return f"{_scaled(v, _DECIMAL, 'B')} ({_scaled(v, _BINARY, 'B')})" if abs(v) >= 1000 else f"{v:,.0f} B"
    if fig.unit in ("FLOP", "FLOP/s"):
        for prefix, size in _SI:
            if abs(v) >= size:
                return f"{v / size:,.2f} {prefix}{fig.unit}"
        return f"{v:,.0f} {fig.unit}"
    if fig.unit == "s":
        return f"{v * 1000:,.2f} ms" if v < 1 else f"{v:,.3f} s"
    if fig.unit == "$":
        return f"${v:,.4f}"
    if fig.unit in ("tokens", "requests", "instances"):
        return f"{v:,.0f} {fig.unit}" if float(v).is_integer() else f"{v:,.2f} {fig.unit}"
    if fig.unit == "tok/s":
        return f"{v:,.1f} tok/s"
    if fig.unit == "x":
        return f"{v:,.3g}x"
    return f"{v:,.4g}"


def _summary(plan: Plan) -> list[str]:
    lines = [f"plan: {plan.prefill.final} prefill + {plan.decode.final} decode instances "
             f"(binding: prefill {plan.prefill.binding}, decode {plan.decode.binding}); "
             f"decode batch B* = {plan.batch} at {plan.decode_tok_s:,.1f} tok/s per decode instance"]
    if plan.fleet:
        needs = ", ".join(f"{k} {v}" for k, v in plan.fleet.needs.items())
        lines.append(f"from per-instance facts: {plan.fleet.final} instances ({needs}; binding: {plan.fleet.binding})")
    return lines


def print_plan(plan: Plan, console: Console, inputs: list[str], command: str) -> None:
    console.rule("pdcluster plan")
    for line in inputs:
        console.print(Text(line))
    for title, figures in plan.sections:
        table = Table(title=title, title_justify="left", show_lines=False)
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_column("= formula (inputs substituted)", overflow="fold")
        for fig in figures:
            table.add_row(Text(fig.label), Text(human(fig)), Text(fig.formula))
        console.print(table)
    _footer(plan, console, command)


def print_explain(plan: Plan, console: Console, inputs: list[str], command: str) -> None:
    """Each figure as three lines: the rule, the rule with its inputs, the result."""
    for line in inputs:
        console.print(Text(line), soft_wrap=True)
    step = 0
    for title, figures in plan.sections:
        console.print(Text(f"\n{title}", style="bold"))
        for fig in figures:
            step += 1
            console.print(Text(f"{step:3}. {fig.label} [{fig.key}]"), soft_wrap=True)
            if fig.rule and fig.rule != fig.formula:
                console.print(Text(f"       = {fig.rule}"), soft_wrap=True)
            console.print(Text(f"       = {fig.formula}"), soft_wrap=True)
            console.print(Text(f"       = {human(fig)}"), soft_wrap=True)
    console.print()
    _footer(plan, console, command)


def _footer(plan: Plan, console: Console, command: str) -> None:
    for warning in plan.warnings:
        console.print(Text(f"warning: {warning}"), soft_wrap=True)
    for line in _summary(plan):
        console.print(Text(line), soft_wrap=True)
    console.print(Text(f"reproduce: {command}"), soft_wrap=True)


def _finite(value):
    """JSON has no NaN or infinity: those become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def plan_json(plan: Plan, profile: object | None, inputs: dict | None = None, reproduce: str = "") -> dict:
    """The plan as JSON; the keys are documented in docs/planning.md ("Capacity planning").  ``profile``: the
    dataclass a measured endpoint gave (bench/plan/profiling.py Profile), or None for datasheet speeds."""
    def pool(size) -> dict:
        return {**asdict(size), "binding": size.binding}

    data = {
        "schema": JSON_SCHEMA,
        "inputs": {k: asdict(v) if is_dataclass(v) else v for k, v in (inputs or {}).items()},
        "sections": {title: [asdict(f) for f in figures] for title, figures in plan.sections},
        "figures": {f.key: {"section": title, "label": f.label, "value": f.value, "unit": f.unit,
                            "rule": f.rule, "formula": f.formula}
                    for title, figures in plan.sections for f in figures},
        "prefill": pool(plan.prefill),
        "decode": pool(plan.decode),
        "fleet": {"needs": plan.fleet.needs, "final": plan.fleet.final, "binding": plan.fleet.binding} if plan.fleet else None,
        "batch": plan.batch,
        "decode_tok_s": plan.decode_tok_s,
        "warnings": plan.warnings,
        "reproduce": reproduce,
    }
    if profile is not None:
        data["profile"] = asdict(profile)
    return _finite(data)
