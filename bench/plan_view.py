"""Prints a plan: one table per section, every figure beside its formula with
the inputs substituted, then warnings and the command that reproduces it."""

from __future__ import annotations

from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from bench.perf_model import StepModel
from bench.planner import Figure, Plan
from bench.profile import Profile


def human(fig: Figure) -> str:
    v = fig.value
    if fig.unit == "B":
        for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if v >= size:
                return f"{v / size:,.2f} {unit}"
        return f"{v:,.0f} B"
    if fig.unit == "s":
        return f"{v * 1000:,.2f} ms" if v < 1 else f"{v:,.3f} s"
    if fig.unit == "$":
        return f"${v:,.4f}"
    if fig.unit in ("tokens", "requests", "instances"):
        return f"{v:,.0f} {fig.unit}"
    if fig.unit == "tok/s":
        return f"{v:,.1f} tok/s"
    return f"{v:,.3g}{fig.unit}"


def print_plan(plan: Plan, console: Console, inputs: list[str], command: str) -> None:
    console.rule("pdcluster plan")
    for line in inputs:
        console.print(line)
    for title, figures in plan.sections:
        table = Table(title=title, title_justify="left", show_lines=False)
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_column("= formula (inputs substituted)", overflow="fold")
        for fig in figures:
            table.add_row(fig.label, human(fig), fig.formula)
        console.print(table)
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    console.print(
        f"plan: {plan.prefill.final} prefill + {plan.decode.final} decode instances "
        f"(binding: prefill {plan.prefill.binding}, decode {plan.decode.binding}); "
        f"decode batch B* = {plan.batch} at {plan.decode_tok_s:,.1f} tok/s per decode instance"
    )
    console.print(f"reproduce: {command}")


def print_profile(profile: Profile, console: Console) -> None:
    console.rule(f"profile of {profile.url} ({profile.model})")
    table = Table(title="prefill: TTFT of 1-token requests vs prompt length", title_justify="left")
    for column in ("prompt tokens", "TTFT ms", "fit ms"):
        table.add_column(column, justify="right")
    for s in profile.prefill_samples:
        table.add_row(str(s.prompt_tokens), f"{s.ttft_s * 1000:.1f}", f"{profile.prefill.time_s(s.prompt_tokens) * 1000:.1f}")
    console.print(table)
    console.print(f"prefill fit: {profile.prefill.describe('n')}  ->  "
                  f"{1 / profile.prefill.per_token_s:,.0f} tok/s")
    table = Table(title="decode: median inter-token gap vs batch", title_justify="left")
    for column in ("batch", "step ms", "fit ms", "tok/s", "gaps"):
        table.add_column(column, justify="right")
    for s in profile.decode_samples:
        table.add_row(str(s.batch), f"{s.step_s * 1000:.2f}", f"{profile.step.step_s(s.batch) * 1000:.2f}",
                      f"{s.batch / s.step_s:,.1f}", str(s.gaps))
    console.print(table)
    console.print(f"step fit: {profile.step.describe('B')}")


def closed_loop_tok_s(step: StepModel, prefill_s: float, batch: int, output_tokens: int) -> float:
    """Predicted output tok/s of a closed loop of ``batch`` requests, each
    waiting ``prefill_s`` for its first token then ``output_tokens - 1`` steps."""
    return batch * output_tokens / (prefill_s + (output_tokens - 1) * step.step_s(batch))


def print_verification(plan: Plan, profile: Profile, console: Console, in_tokens: int = 32, out_tokens: int = 128) -> None:
    """How to check the prediction with bench, and what to expect."""
    b = plan.batch
    measured_max = max(s.batch for s in profile.decode_samples)
    decode_only = b / profile.step.step_s(b)
    closed = closed_loop_tok_s(profile.step, profile.prefill.time_s(in_tokens), b, out_tokens)
    console.print(
        f"prediction at B* = {b}: decode {decode_only:,.1f} tok/s (B* / step(B*)); closed loop of "
        f"{in_tokens}-in/{out_tokens}-out requests {closed:,.1f} output tok/s "
        f"(B* x {out_tokens} / (prefill({in_tokens}) + {out_tokens - 1} x step(B*)))"
    )
    if b > measured_max:
        console.print(f"[yellow]warning:[/] B* {b} is beyond the largest profiled batch {measured_max}: "
                      f"profile larger batches (--profile-batches) before trusting it")
    console.print(f"verify: pdcluster bench --url {profile.url} --workload decode --concurrency {b} "
                  f"--requests {max(4 * b, 32)}   (compare its output tok/s with {closed:,.1f})")


def plan_json(plan: Plan, profile: Profile | None) -> dict:
    data = {
        "sections": {title: [asdict(f) for f in figures] for title, figures in plan.sections},
        "prefill": asdict(plan.prefill),
        "decode": asdict(plan.decode),
        "batch": plan.batch,
        "decode_tok_s": plan.decode_tok_s,
        "warnings": plan.warnings,
    }
    if profile is not None:
        data["profile"] = asdict(profile)
    return data
