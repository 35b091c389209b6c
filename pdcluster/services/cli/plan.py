"""`pdcluster plan`: memory budgets and replica counts for the prefill and
decode pools, from datasheet figures or from a profile of a running endpoint,
and the capacity-planning figures around them (KV per request, token demand,
prefill FLOPs, E2E, prefix-cache savings, speculative decoding, pipeline
bubble, cost at capacity, instances from measured per-instance facts).

Traffic and SLOs default to a workload's (``--workload mixed``); explicit
flags override them.  Every printed figure shows its rule with the inputs
substituted; ``--explain`` walks through them one by one, ``--json -``
prints them as JSON (schema in docs/planning.md, "Capacity planning")."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from pdcluster.planning.inputs import (
    ACCELERATOR_PRESETS, DTYPE_BYTES, GB, GiB, KV_SCALE_BYTES, MODEL_PRESETS, Deployment, PerInstance, Pipeline, PrefixCache,
    Questions, Slos, Speculation, Traffic, tp_problem,
)
from pdcluster.services.cli.checkout import BenchMissing, bench_module
from pdcluster.services.cli.plan_args import add_arguments, fail, one_line_errors
from pdcluster.services.model_meta import read_model_shape

# Heavier imports (rich, numpy, aiohttp, transformers) happen inside the
# functions so that registering the subcommand keeps `pdcluster` fast.  A
# workload's traffic and a profile of an endpoint come from bench/, which
# only a checkout has (checkout.py): traffic and SLOs given as flags plan
# without it.

DEFAULT_RESERVE_FRACTION = Deployment().reserve_fraction


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="size prefill/decode pools from model, hardware, traffic and SLOs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(one_line_errors(p))
    p.set_defaults(func=main)


def build_parser() -> argparse.ArgumentParser:
    """`pdcluster plan` on its own (tests, ``python -m pdcluster.services.cli.plan``)."""
    p = one_line_errors(argparse.ArgumentParser(prog="pdcluster plan", description=__doc__,
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
    add_arguments(p)
    return p


# --- from flags to inputs -------------------------------------------------

# Flags a cluster config can set: (flag dest, default without a config).
CONFIG_DEFAULTS = {"weight_dtype": "bf16", "kv_dtype": "bf16", "block_size": Deployment().block_size}
_CONFIG_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "bf16": "bf16", "int8": "int8", "fp8_e4m3": "fp8"}


def settings_from_config(args: argparse.Namespace) -> list[str]:
    """Fills the model flags left unset from ``--config`` (the cluster's own
    settings, so the planner's KV bytes and speculation model are the
    cluster's), then from CONFIG_DEFAULTS; returns notes naming what came
    from the config."""
    notes: list[str] = []
    if args.config:
        from pdcluster.services.config import ClusterConfig

        cfg = ClusterConfig.from_yaml(args.config)
        weight = _CONFIG_DTYPES[cfg.dtype]
        # weight_dtype int8 quantizes the decoder projections (pdcluster/services/engine/model/weight_quant.py); the
        # embeddings stay in the model dtype, so 1 byte a parameter slightly understates a small model's bytes
        found = {"model": cfg.model, "weight_dtype": "int8" if cfg.weight_dtype == "int8" else weight,
                 "block_size": cfg.block_size,
                 "kv_dtype": weight if cfg.kv_cache_dtype == "auto" else _CONFIG_DTYPES[cfg.kv_cache_dtype]}
        # speculation's k: only when the acceptance question is asked (--spec-accept/--spec-cost)
        if cfg.speculative.method != "none" and (args.spec_accept is not None or args.spec_cost is not None):
            found["spec_k"] = cfg.speculative.num_tokens
        for dest, value in found.items():
            if getattr(args, dest) is None and value is not None:
                setattr(args, dest, value)
                notes.append(f"--{dest.replace('_', '-')} {value} from {args.config}")
    for dest, value in CONFIG_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    return notes


def model_shape(args):
    shape = read_model_shape(args.model)
    overrides = {"params": args.params, "num_layers": args.layers, "num_heads": args.heads,
                 "num_kv_heads": args.kv_heads, "head_dim": args.head_dim}
    return replace(shape, **{k: v for k, v in overrides.items() if v is not None})


def accelerator(args):
    a = ACCELERATOR_PRESETS[args.accelerator]
    memory = args.memory_gib * GiB if args.memory_gib is not None else args.memory_gb * GB if args.memory_gb is not None else None
    overrides = {"memory_bytes": memory,
                 "bandwidth_bytes_s": args.bandwidth_gbs * GB if args.bandwidth_gbs is not None else None,
                 "flops": args.tflops * 1e12 if args.tflops is not None else None}
    return replace(a, **{k: v for k, v in overrides.items() if v is not None})


def reserve_fraction(args) -> float:
    """--reserve-gib replaces the fraction (they never stack; argparse refuses both)."""
    if args.reserve_fraction is not None:
        return args.reserve_fraction
    return 0.0 if args.reserve_gib is not None else DEFAULT_RESERVE_FRACTION


def deployment(args) -> Deployment:
    return Deployment(
        tp=args.tp, weight_bytes=DTYPE_BYTES[args.weight_dtype], kv_bytes=DTYPE_BYTES[args.kv_dtype],
        kv_scale_bytes=KV_SCALE_BYTES.get(args.kv_dtype, 0),
        reserve_fraction=reserve_fraction(args), reserve_bytes=(args.reserve_gib if args.reserve_gib is not None else 0.0) * GiB, block_size=args.block_size,
        safety=args.safety, mbu=args.mbu, mfu=args.mfu, max_num_seqs=args.max_num_seqs,
        redundancy=args.redundancy, price_per_instance_hour=args.price_per_hour,
    )


def _from_bench(name: str, why: str):
    try:
        return bench_module(name)
    except BenchMissing as exc:
        raise BenchMissing(f"{why}: {exc}") from None


@functools.lru_cache(maxsize=8)
def _workload_stats(name: str):
    return bench_module("bench.load.schedule").traffic_stats(bench_module("bench.workload").load_workload(name))


def _traffic_source(args) -> str:
    given = None not in (args.rps, args.input_mean, args.output_mean, args.ttft, args.tpot)
    return "from flags" if given else f"workload {args.workload} unless overridden"


def traffic_and_slos(args) -> tuple[Traffic, Slos, list[str]]:
    """Flags over the workload's values (read only when a flag is missing); the notes say where each came
    from when it is not obvious."""
    workload = None
    if _traffic_source(args) != "from flags":
        workload = _from_bench("bench.workload", f"--workload {args.workload} (or give --rps, --input-mean, "
                                                 f"--output-mean, --ttft and --tpot)").load_workload(args.workload)
    notes = []
    rps = args.rps
    if rps is None:
        if workload.arrival.kind != "poisson":
            raise ValueError(f"workload {workload.name} has no poisson rate: pass --rps")
        rps = workload.arrival.rate_rps
    lengths = {}
    for kind in ("input", "output"):
        mean, p95 = getattr(args, f"{kind}_mean"), getattr(args, f"{kind}_p95")
        if mean is not None and p95 is None:
            p95 = mean
            notes.append(f"{kind} p95 = --{kind}-mean {mean:g} (a mean given without --{kind}-p95 replaces the workload's lengths)")
        if mean is None or p95 is None:
            stats = _workload_stats(args.workload)
            mean = mean if mean is not None else getattr(stats, f"{kind}_mean")
            p95 = p95 if p95 is not None else getattr(stats, f"{kind}_p95")
        lengths[kind] = (mean, p95)

    def slo(metric: str, flag: float | None, fallback: float) -> float:
        if flag is not None:
            return flag
        bounds = [s.max_s for s in workload.slos if s.metric == metric]
        return min(bounds) if bounds else fallback

    traffic = Traffic(rps, *lengths["input"], *lengths["output"])
    return traffic, Slos(slo("ttft", args.ttft, 1.0), slo("tpot", args.tpot, 0.1)), notes


def _together(args, flags: tuple[str, ...]) -> bool:
    """True if all of ``flags`` were given, False if none; an error if some."""
    given = [getattr(args, f.lstrip("-").replace("-", "_")) is not None for f in flags]
    if any(given) and not all(given):
        missing = [f for f, g in zip(flags, given) if not g]
        raise ValueError(f"{', '.join(flags)} go together: also give {' and '.join(missing)}")
    return all(given)


def questions(args) -> Questions:
    return Questions(
        concurrency=args.concurrency,
        queue_s=args.queue_s,
        dwell_s=args.dwell_s,
        prefix=(PrefixCache(args.shared_prefix_tokens, args.prefix_hit_rate)
                if _together(args, ("--shared-prefix-tokens", "--prefix-hit-rate")) else None),
        spec=(Speculation(args.spec_k, args.spec_accept, args.spec_cost)
              if _together(args, ("--spec-k", "--spec-accept", "--spec-cost")) else None),
        pipeline=Pipeline(args.pp, args.micro_batches) if _together(args, ("--pp", "--micro-batches")) else None,
        per_instance=PerInstance(args.instance_tok_s, args.active_per_instance, args.kv_safe_per_instance),
    )


def _profile(args, console):
    profiling = _from_bench("bench.plan.profiling", "--profile")
    ProfileSettings, profile_endpoint = profiling.ProfileSettings, profiling.profile_endpoint
    load_tokenizer = bench_module("bench.tokenizer").load_tokenizer

    settings = ProfileSettings(prompt_lengths=args.profile_prompts, batches=tuple(args.profile_batches),
                               decode_tokens=args.profile_tokens,
                               prefill_max_tokens=min(ProfileSettings.prefill_max_tokens, args.profile_tokens))
    console.print(f"profiling {args.profile} (prefill at {list(settings.prompt_lengths)} tokens, decode at batches {list(settings.batches)}) ...")
    profile = asyncio.run(profile_endpoint(args.profile, load_tokenizer(args.tokenizer), settings))
    bench_module("bench.plan.profile_view").print_profile(profile, console)
    return profile


def reproduce_command(args: argparse.Namespace) -> str:
    """Every option spelled out, so the plan does not depend on defaults."""
    values = dict(vars(args), reserve_fraction=reserve_fraction(args))
    parts = ["pdcluster", "plan"]
    for dest, value in sorted(values.items()):
        if dest in ("func", "command", "json", "explain", "config") or value is None:
            continue
        if dest.startswith("profile_") and not args.profile:
            continue
        if isinstance(value, tuple):
            value = ",".join(str(v) for v in value)
        elif isinstance(value, float):
            value = str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
        parts += [f"--{dest.replace('_', '-')}", str(value)]
    return shlex.join(parts)


def input_lines(args, shape, hw, dep, traffic, slos, profiled: bool) -> list[str]:
    return [
        f"model: {shape.name}: {shape.params:,.0f} params, {shape.num_layers} layers, {shape.num_heads} heads, "
        f"{shape.num_kv_heads} KV heads, head_dim {shape.head_dim}; weights {args.weight_dtype}, KV {args.kv_dtype}",
        f"device: {hw.name}: {hw.memory_bytes / GB:,.2f} GB ({hw.memory_bytes / GiB:,.2f} GiB), "
        f"{hw.bandwidth_bytes_s / GB:,.0f} GB/s, {hw.flops / 1e12:,.1f} TFLOP/s; tp {dep.tp}; "
        f"reserve {dep.reserve_fraction:g} + {dep.reserve_bytes / GiB:g} GiB; "
        f"speeds from {'profile of ' + args.profile if profiled else 'datasheet rooflines'}",
        f"traffic: {traffic.peak_rps:g} req/s; input mean {traffic.input_mean:,.0f} p95 {traffic.input_p95:,.0f}; "
        f"output mean {traffic.output_mean:,.0f} p95 {traffic.output_p95:,.0f} ({_traffic_source(args)})",
        f"SLOs: TTFT {slos.ttft_s:g} s, TPOT {slos.tpot_s:g} s",
    ]


# --- the command ----------------------------------------------------------


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run the planner; ``args`` is parsed flags, or a list of them (``None``: sys.argv)."""
    if not isinstance(args, argparse.Namespace):
        try:
            args = build_parser().parse_args(args)
        except SystemExit as exc:  # argparse has printed its one line (or --help)
            return int(exc.code or 0)
    from rich.console import Console

    from pdcluster.planning.planner import make_plan
    from pdcluster.planning.view import plan_json, print_explain, print_plan

    json_only = args.json is not None and str(args.json) == "-"
    console = Console(stderr=json_only)
    try:
        from_config = settings_from_config(args)
        profile = _profile(args, console) if args.profile else None
        if args.model is not None and args.model not in MODEL_PRESETS and Path(args.model).exists():
            console.print(f"reading the model shape from {args.model} ...")
        shape, hw, dep = model_shape(args), accelerator(args), deployment(args)
        if (problem := tp_problem(shape, dep.tp)) is not None:
            return fail(problem)
        traffic, slos, notes = traffic_and_slos(args)
        asked = questions(args)
        plan = make_plan(shape, hw, dep, traffic, slos, context_tokens=args.context, questions=asked,
                         step=profile.step if profile else None, prefill=profile.prefill if profile else None)
    except (ValueError, OSError, RuntimeError) as exc:
        return fail(exc)
    notes = from_config + notes
    inputs = input_lines(args, shape, hw, dep, traffic, slos, profile is not None) + [f"note: {n}" for n in notes]
    command = reproduce_command(args)
    if args.json is not None:
        data = plan_json(plan, profile, reproduce=command, inputs=dict(
            model=shape, accelerator=hw, deployment=dep, traffic=traffic, slos=slos, questions=asked,
            context_tokens=args.context, workload=args.workload, notes=notes))
        text = json.dumps(data, indent=1)
        if json_only:
            print(text)
            return 0
        try:
            args.json.write_text(text)
        except OSError as exc:
            return fail(f"--json {args.json}: {exc}")
    (print_explain if args.explain else print_plan)(plan, console, inputs, command)
    if profile:
        bench_module("bench.plan.profile_view").print_verification(plan, profile, console)
    if args.json is not None:
        console.print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
