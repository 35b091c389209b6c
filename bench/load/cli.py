"""`pdcluster bench`: run a workload (or a sweep of it) against any
OpenAI-compatible endpoint and report against its SLOs."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import shlex
from pathlib import Path

# Heavy imports (aiohttp, matplotlib, transformers) happen inside main() so
# that registering the subcommand keeps every `pdcluster` invocation fast.
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="load-test an OpenAI-compatible endpoint against SLOs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    p.add_argument("--workload", default="tiny", help="YAML path or bundled name: mixed, tiny, decode (default: %(default)s)")
    p.add_argument("--model", help="model name to send (default: the workload's, else the server's first /v1/models)")
    p.add_argument("--tokenizer", help="GGUF file, HF model dir, or 'whitespace' (default: the default model's GGUF)")
    p.add_argument("--endpoint", choices=["completions", "chat"], help="override the workload's endpoint")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="open loop: poisson arrivals at this many req/s")
    load.add_argument("--concurrency", type=int, help="closed loop: this many requests in flight")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("--requests", type=int, help="stop after this many requests")
    p.add_argument("--seed", type=int, help="override the workload's seed")
    p.add_argument("--sweep", nargs="?", const="workload", metavar="KIND=L1,L2,...",
                   help="sweep load to find the knee: concurrency=1,2,4,8 or rate=1,2,4 (bare: the workload's sweep)")
    p.add_argument("--out", type=Path, help=f"output directory (default: {RESULTS_DIR}/<workload>-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.set_defaults(func=main)


def reproduce_command(args: argparse.Namespace, workload, model: str | None) -> str:
    parts = ["pdcluster", "bench", "--url", args.url, "--workload", args.workload, "--seed", str(workload.seed)]
    for flag, value in (("--model", model), ("--tokenizer", args.tokenizer), ("--endpoint", args.endpoint),
                        ("--rate", args.rate), ("--concurrency", args.concurrency), ("--duration", args.duration),
                        ("--requests", args.requests)):
        if value is not None:
            parts += [flag, str(value)]
    if args.sweep is not None:
        parts += ["--sweep"] + ([] if args.sweep == "workload" else [args.sweep])
    return shlex.join(parts)


def resolve_sweep(spec: str, workload, args: argparse.Namespace):
    from bench.load.sweep import parse_sweep
    from bench.workload import Sweep

    if spec == "workload":
        if workload.sweep is None:
            raise ValueError(f"workload {workload.name} has no sweep section: pass --sweep concurrency=1,2,4,8")
        sweep = workload.sweep
    else:
        kind, levels = parse_sweep(spec)
        base = workload.sweep
        sweep = Sweep(kind=kind, values=levels, duration_s=base.duration_s if base else None,
                      num_requests=base.num_requests if base else None)
    if args.duration is not None or args.requests is not None:
        sweep = sweep.model_copy(update={"duration_s": args.duration, "num_requests": args.requests})
    return sweep


def output_dir(args: argparse.Namespace, workload) -> Path:
    out = args.out or RESULTS_DIR / f"{workload.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from bench.fingerprint import print_fingerprint

    print_fingerprint()
    console = Console()
    try:
        return _bench(args, console)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        console.print(f"[red]bench: {exc}[/]")
        return 2


def _bench(args: argparse.Namespace, console) -> int:
    from bench.load.loadgen import run_workload
    from bench.load.plots import plot_run, plot_sweep
    from bench.load.report import build_report, report_json
    from bench.load.report_view import print_report
    from bench.load.sweep import run_sweep
    from bench.load.sweep_view import print_sweep, sweep_json
    from bench.tokenizer import load_tokenizer
    from bench.workload import load_workload, with_overrides

    workload = with_overrides(
        load_workload(args.workload), rate_rps=args.rate, concurrency=args.concurrency,
        duration_s=args.duration if args.sweep is None else None,
        num_requests=args.requests if args.sweep is None else None,
        seed=args.seed, model=args.model, endpoint=args.endpoint,
    )
    sweep = resolve_sweep(args.sweep, workload, args) if args.sweep is not None else None
    console.print(f"loading tokenizer {args.tokenizer or 'default (SmolLM2-135M-Instruct GGUF)'} ...")
    tokenizer = load_tokenizer(args.tokenizer)
    command = reproduce_command(args, workload, workload.model)
    out = output_dir(args, workload)
    show = not args.no_progress
    if sweep is None:
        result = asyncio.run(run_workload(args.url, workload, tokenizer, show_progress=show))
        report = build_report(result, command)
        json_path = out / "report.json"
        json_path.write_text(json.dumps(report_json(report, result), indent=1))
        if not args.no_plot:
            console.print(f"plot: {plot_run(result, out / 'report.png')}")
        print_report(report, console, str(json_path))
        return 0 if report.overall.ok else 1
    result = asyncio.run(run_sweep(args.url, workload, tokenizer, sweep, command, show_progress=show))
    json_path = out / "sweep.json"
    json_path.write_text(json.dumps(sweep_json(result), indent=1))
    if not args.no_plot:
        path = plot_sweep(result.kind, result.levels, result.results, result.reports, result.knee.knee, out / "sweep.png")
        console.print(f"plot: {path}")
    print_sweep(result, console, str(json_path))
    return 0
