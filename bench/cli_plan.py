"""`pdcluster plan`: memory budgets and replica counts for the prefill and
decode pools, from datasheet figures or from a profile of a running endpoint.

Traffic and SLOs default to a workload's (``--workload mixed``); explicit
flags override them.  Every printed figure shows its formula's inputs."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
from dataclasses import replace
from pathlib import Path

from bench.plan_inputs import ACCELERATOR_PRESETS, DTYPE_BYTES, GiB, MODEL_PRESETS, Deployment, Slos, Traffic, read_model_shape

# Heavier imports (rich, numpy, aiohttp, transformers) happen inside the
# functions so that registering the subcommand keeps `pdcluster` fast.


def _floats(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="size prefill/decode pools from model, hardware, traffic and SLOs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", help=f"preset ({', '.join(MODEL_PRESETS)}), .gguf file or HF dir (default: the default model's GGUF)")
    for flag, kind in (("--params", float), ("--layers", int), ("--heads", int), ("--kv-heads", int), ("--head-dim", int)):
        m.add_argument(flag, type=kind, help="override the model's value")
    m.add_argument("--weight-dtype", default="bf16", choices=DTYPE_BYTES, help="(default: %(default)s)")
    m.add_argument("--kv-dtype", default="bf16", choices=DTYPE_BYTES, help="(default: %(default)s)")
    h = p.add_argument_group("hardware and deployment")
    h.add_argument("--accelerator", default="h100-sxm", choices=ACCELERATOR_PRESETS, help="datasheet preset (default: %(default)s)")
    h.add_argument("--memory-gib", type=float, help="override device memory")
    h.add_argument("--bandwidth-gbs", type=float, help="override device memory bandwidth, GB/s")
    h.add_argument("--tflops", type=float, help="override device dense bf16 TFLOP/s")
    d = Deployment()
    for flag, default, kind, what in (
        ("--tp", d.tp, int, "devices per instance"), ("--reserve-fraction", d.reserve_fraction, float, "memory held back"),
        ("--reserve-gib", 0.0, float, "more memory held back, GiB"), ("--block-size", d.block_size, int, "KV block tokens"),
        ("--safety", d.safety, float, "fraction of max concurrency to plan for"), ("--mbu", d.mbu, float, "achieved/peak bandwidth"),
        ("--mfu", d.mfu, float, "achieved/peak FLOP/s"), ("--max-num-seqs", d.max_num_seqs, int, "scheduler batch limit"),
        ("--redundancy", d.redundancy, float, "instance multiplier"), ("--price-per-hour", 0.0, float, "$ per instance-hour"),
    ):
        h.add_argument(flag, type=kind, default=default, help=f"{what} (default: %(default)s)")
    t = p.add_argument_group("traffic and SLOs (default: the workload's)")
    t.add_argument("--workload", default="mixed", help="workload whose lengths, rate and SLOs to use (default: %(default)s)")
    for flag in ("--rps", "--input-mean", "--input-p95", "--output-mean", "--output-p95", "--context", "--ttft", "--tpot"):
        t.add_argument(flag, type=float, help="override")
    f = p.add_argument_group("profile a running endpoint instead of datasheet speeds")
    f.add_argument("--profile", metavar="URL", help="measure prefill rate and decode step vs batch at this OpenAI URL")
    f.add_argument("--profile-batches", type=_floats, default=(1, 2, 4, 8, 16), help="decode batches (default: 1,2,4,8,16)")
    f.add_argument("--profile-prompts", type=_floats, default=(128, 256, 512, 1024), help="prefill lengths (default: 128,256,512,1024)")
    f.add_argument("--profile-tokens", type=int, default=64, help="tokens per decode probe (default: %(default)s)")
    f.add_argument("--tokenizer", help="for profile prompts: GGUF, HF dir or 'whitespace' (default: the default GGUF)")
    p.add_argument("--json", type=Path, help="also write the plan as JSON here")
    p.set_defaults(func=main)


def model_shape(args):
    from bench.tokenizer import locate_default_gguf

    shape = read_model_shape(args.model or str(locate_default_gguf()))
    overrides = {"params": args.params, "num_layers": args.layers, "num_heads": args.heads,
                 "num_kv_heads": args.kv_heads, "head_dim": args.head_dim}
    return replace(shape, **{k: v for k, v in overrides.items() if v is not None})


def accelerator(args):
    a = ACCELERATOR_PRESETS[args.accelerator]
    overrides = {"memory_bytes": args.memory_gib and args.memory_gib * GiB, "bandwidth_bytes_s": args.bandwidth_gbs and args.bandwidth_gbs * 1e9,
                 "flops": args.tflops and args.tflops * 1e12}
    return replace(a, **{k: v for k, v in overrides.items() if v})


def deployment(args) -> Deployment:
    return Deployment(
        tp=args.tp, weight_bytes=DTYPE_BYTES[args.weight_dtype], kv_bytes=DTYPE_BYTES[args.kv_dtype],
        reserve_fraction=args.reserve_fraction, reserve_bytes=args.reserve_gib * GiB, block_size=args.block_size,
        safety=args.safety, mbu=args.mbu, mfu=args.mfu, max_num_seqs=args.max_num_seqs,
        redundancy=args.redundancy, price_per_instance_hour=args.price_per_hour,
    )


def traffic_and_slos(args) -> tuple[Traffic, Slos]:
    from bench.schedule import traffic_stats
    from bench.workload import Poisson, load_workload

    workload = load_workload(args.workload)
    stats = traffic_stats(workload)
    rps = args.rps or (workload.arrival.rate_rps if isinstance(workload.arrival, Poisson) else None)
    if rps is None:
        raise ValueError(f"workload {workload.name} has no poisson rate: pass --rps")

    def slo(metric: str, fallback: float) -> float:
        bounds = [s.max_s for s in workload.slos if s.metric == metric]
        return min(bounds) if bounds else fallback

    traffic = Traffic(rps, args.input_mean or stats.input_mean, args.input_p95 or stats.input_p95,
                      args.output_mean or stats.output_mean, args.output_p95 or stats.output_p95)
    return traffic, Slos(args.ttft or slo("ttft", 1.0), args.tpot or slo("tpot", 0.1))


def _profile(args, console):
    from bench.plan_view import print_profile
    from bench.profile import ProfileSettings, profile_endpoint
    from bench.tokenizer import load_tokenizer

    settings = ProfileSettings(prompt_lengths=args.profile_prompts, batches=tuple(args.profile_batches),
                               decode_tokens=args.profile_tokens)
    console.print(f"profiling {args.profile} (prefill at {list(settings.prompt_lengths)} tokens, decode at batches {list(settings.batches)}) ...")
    profile = asyncio.run(profile_endpoint(args.profile, load_tokenizer(args.tokenizer), settings))
    print_profile(profile, console)
    return profile


def reproduce_command(args: argparse.Namespace) -> str:
    """Every option spelled out, so the plan does not depend on defaults."""
    parts = ["pdcluster", "plan"]
    for dest, value in sorted(vars(args).items()):
        if dest in ("func", "command", "json") or value is None:
            continue
        if dest.startswith("profile_") and not args.profile:
            continue
        if isinstance(value, tuple):
            value = ",".join(str(v) for v in value)
        parts += [f"--{dest.replace('_', '-')}", str(value)]
    return shlex.join(parts)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from bench.plan_view import plan_json, print_plan, print_verification
    from bench.planner import make_plan

    console = Console()
    try:
        profile = _profile(args, console) if args.profile else None
        if args.model not in MODEL_PRESETS:
            console.print(f"reading the model shape from {args.model or 'the default GGUF'} ...")
        shape, hw, dep = model_shape(args), accelerator(args), deployment(args)
        traffic, slos = traffic_and_slos(args)
        step = profile.step if profile else None
        prefill = profile.prefill if profile else None
        plan = make_plan(shape, hw, dep, traffic, slos, context_tokens=args.context, step=step, prefill=prefill)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        console.print(f"[red]plan: {exc}[/]")
        return 2
    inputs = [
        f"model: {shape.name}: {shape.params:,.0f} params, {shape.num_layers} layers, {shape.num_heads} heads, "
        f"{shape.num_kv_heads} KV heads, head_dim {shape.head_dim}; weights {args.weight_dtype}, KV {args.kv_dtype}",
        f"device: {hw.name}: {hw.memory_bytes / GiB:,.1f} GiB, {hw.bandwidth_bytes_s / 1e9:,.0f} GB/s, "
        f"{hw.flops / 1e12:,.1f} TFLOP/s; tp {dep.tp}; speeds from {'profile of ' + args.profile if profile else 'datasheet rooflines'}",
        f"traffic: {traffic.peak_rps:g} req/s; input mean {traffic.input_mean:,.0f} p95 {traffic.input_p95:,.0f}; "
        f"output mean {traffic.output_mean:,.0f} p95 {traffic.output_p95:,.0f} (workload {args.workload} unless overridden)",
        f"SLOs: TTFT {slos.ttft_s:g} s, TPOT {slos.tpot_s:g} s",
    ]
    print_plan(plan, console, inputs, reproduce_command(args))
    if profile:
        print_verification(plan, profile, console)
    if args.json:
        args.json.write_text(json.dumps(plan_json(plan, profile), indent=1))
        console.print(f"json: {args.json}")
    return 0
