"""Prints what ``pdcluster plan --profile URL`` measured (the prefill and
decode fits beside their samples) and how to check the plan against the
endpoint with ``pdcluster bench``.  The plan's own tables are
pdcluster/planning/view.py."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from bench.plan.profiling import Profile
from pdcluster.planning.planner import Plan
from pdcluster.planning.speed import StepModel


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
