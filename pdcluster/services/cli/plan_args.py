"""The flags of `pdcluster plan`, each with its valid range.

Every value is checked as argparse reads it: a bad one ends the command with
exit status 2 and one line naming the flag and the range, e.g.

    pdcluster plan: error: argument --rps: must be a number in (0, 1e9], got '-5'

Nothing is "0 means default": a flag left out is ``None`` and the caller
picks the default; a flag given is used as given."""

from __future__ import annotations

import argparse
import math
import sys
import types
from pathlib import Path

from pdcluster.planning.inputs import ACCELERATOR_PRESETS, DTYPE_BYTES, MODEL_PRESETS, Deployment


def _bound(x: float) -> str:
    if abs(x) >= 1e7:
        return f"{x:.0e}".replace("e+0", "e").replace("e+", "e")  # 1e9
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def number(lo: float, hi: float, *, integer: bool = False, lo_open: bool = False, hi_open: bool = False):
    """An argparse ``type=`` accepting finite numbers in the range, e.g. ``(0, 1]``."""
    span = f"{'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}{')' if hi_open else ']'}"
    what = f"an integer in {span}" if integer else f"a number in {span}"

    def parse(text: str) -> float | int:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        inside = (lo < value if lo_open else lo <= value) and (value < hi if hi_open else value <= hi)
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def integers(lo: int, hi: int):
    """A comma-separated list of integers, each in [lo, hi]."""
    one = number(lo, hi, integer=True)

    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(one(v) for v in text.split(","))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"a comma-separated list, each {exc}") from None

    parse.__name__ = "integer list"
    return parse


POSITIVE = number(0, 1e9, lo_open=True)
FRACTION = number(0, 1, lo_open=True)  # (0, 1]
PROBABILITY = number(0, 1)  # [0, 1]
TOKENS = number(1, 1e8)


def _one_line_error(parser: argparse.ArgumentParser, message: str) -> None:
    """argparse's error without the usage block: one line, exit status 2."""
    parser.exit(2, f"{parser.prog}: error: {' '.join(message.split())}\n")


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.error = types.MethodType(_one_line_error, parser)
    return parser


def fail(message: object, prog: str = "pdcluster plan") -> int:
    """A planning error after parsing: the same one line, exit status 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", help=f"'default' (the bundled SmolLM2-135M), a preset ({', '.join(MODEL_PRESETS)}), "
                                   ".gguf file or HF dir (default: default)")
    m.add_argument("--params", type=number(0, 1e14, lo_open=True), help="override the parameter count, e.g. 8e9")
    for flag, hi in (("--layers", 1000), ("--heads", 1024), ("--kv-heads", 1024), ("--head-dim", 4096)):
        m.add_argument(flag, type=number(1, hi, integer=True), help=f"override the model's value, 1..{hi}")
    m.add_argument("--config", help="a cluster config (deploy/*.yaml): its model, dtype, kv_cache_dtype, block_size "
                                    "and speculative.num_tokens become the defaults of --model, --weight-dtype, "
                                    "--kv-dtype, --block-size and --spec-k (flags given win)")
    # None: from --config, else the default in pdcluster/services/cli/plan.py CONFIG_DEFAULTS
    m.add_argument("--weight-dtype", choices=DTYPE_BYTES, help="(default: the config's dtype, else bf16)")
    m.add_argument("--kv-dtype", choices=DTYPE_BYTES, help="(default: the config's kv_cache_dtype, else bf16)")

    h = p.add_argument_group("hardware and deployment")
    h.add_argument("--accelerator", default="h100-sxm", choices=ACCELERATOR_PRESETS, help="datasheet preset (default: %(default)s)")
    memory = h.add_mutually_exclusive_group()
    memory.add_argument("--memory-gib", type=number(0, 1e5, lo_open=True), help="override device memory, GiB (2^30 B)")
    memory.add_argument("--memory-gb", type=number(0, 1e5, lo_open=True), help="override device memory, GB (1e9 B)")
    h.add_argument("--bandwidth-gbs", type=number(0, 1e6, lo_open=True), help="override device memory bandwidth, GB/s (1e9 B/s)")
    h.add_argument("--tflops", type=number(0, 1e6, lo_open=True), help="override device dense bf16 TFLOP/s")
    d = Deployment()
    h.add_argument("--block-size", type=number(1, 4096, integer=True),
                   help=f"KV block tokens (default: the config's block_size, else {d.block_size})")
    h.add_argument("--tp", type=number(1, 1024, integer=True), default=d.tp, help="devices per instance (default: %(default)s)")
    reserve = h.add_mutually_exclusive_group()
    reserve.add_argument("--reserve-fraction", type=number(0, 1, hi_open=True),
                         help=f"fraction of device memory held back (default: {d.reserve_fraction:g}; 0 with --reserve-gib)")
    reserve.add_argument("--reserve-gib", type=number(0, 1e5), help="memory held back per device, GiB, instead of a fraction")
    for flag, default, kind, what in (
        ("--safety", d.safety, FRACTION, "fraction of max concurrency to plan for, (0, 1]"),
        ("--mbu", d.mbu, FRACTION, "achieved/peak bandwidth, (0, 1]"),
        ("--mfu", d.mfu, FRACTION, "achieved/peak FLOP/s, (0, 1]"),
        ("--max-num-seqs", d.max_num_seqs, number(1, 1e6, integer=True), "scheduler batch limit"),
        ("--redundancy", d.redundancy, number(1, 100), "instance multiplier, >= 1"),
        ("--price-per-hour", 0.0, number(0, 1e6), "$ per instance-hour"),
    ):
        h.add_argument(flag, type=kind, default=default, help=f"{what} (default: %(default)s)")

    t = p.add_argument_group("traffic and SLOs (default: the workload's; a mean given without its p95 sets the p95 too)")
    t.add_argument("--workload", default="mixed", help="workload whose lengths, rate and SLOs to use (default: %(default)s)")
    t.add_argument("--rps", type=POSITIVE, help="peak requests per second")
    for flag in ("--input-mean", "--input-p95", "--output-mean", "--output-p95"):
        t.add_argument(flag, type=TOKENS, help="tokens")
    t.add_argument("--context", type=number(1, 1e9), help="tokens one request holds (default: input_p95 + output_p95)")
    t.add_argument("--ttft", type=number(0, 1e5, lo_open=True), help="TTFT SLO, s")
    t.add_argument("--tpot", type=number(0, 1e5, lo_open=True), help="TPOT SLO, s")
    t.add_argument("--queue-s", type=number(0, 1e5), default=0.0, help="mean queueing delay for E2E, s (default: %(default)s)")
    t.add_argument("--concurrency", type=number(1, 1e9, integer=True), help="N requests in flight: KV for N, and the KV rule's N")

    f = p.add_argument_group("instances from per-instance facts (max of the three, x redundancy)")
    f.add_argument("--instance-tok-s", type=POSITIVE, help="output tok/s one instance sustains (measured)")
    f.add_argument("--dwell-s", type=number(0, 1e6, lo_open=True), help="s a request stays in an instance (default: E2E at the SLOs)")
    f.add_argument("--active-per-instance", type=POSITIVE, help="requests one instance holds in flight within SLOs")
    f.add_argument("--kv-safe-per-instance", type=POSITIVE, help="requests whose KV one instance holds (default: computed)")

    q = p.add_argument_group("prefix cache, speculative decoding, pipeline")
    q.add_argument("--shared-prefix-tokens", type=number(0, 1e8), help="tokens of each prompt shared (system prompt)")
    q.add_argument("--prefix-hit-rate", type=PROBABILITY, help="fraction of requests that find their prefix cached, [0, 1]")
    q.add_argument("--spec-k", type=number(1, 64, integer=True), help="draft tokens per step, 1..64")
    q.add_argument("--spec-accept", type=PROBABILITY, help="per-token acceptance rate a, [0, 1]")
    q.add_argument("--spec-cost", type=FRACTION, help="draft cost per token / target cost c, (0, 1]")
    q.add_argument("--pp", type=number(1, 1024, integer=True), help="pipeline stages s (bubble figures only)")
    q.add_argument("--micro-batches", type=number(1, 1e6, integer=True), help="micro-batches m per batch (GPipe)")

    r = p.add_argument_group("profile a running endpoint instead of datasheet speeds")
    r.add_argument("--profile", metavar="URL", help="measure prefill rate and decode step vs batch at this OpenAI URL")
    r.add_argument("--profile-batches", type=integers(1, 4096), default=(1, 2, 4, 8, 16), help="decode batches (default: 1,2,4,8,16)")
    r.add_argument("--profile-prompts", type=integers(1, 1_000_000), default=(128, 256, 512, 1024),
                   help="prefill lengths (default: 128,256,512,1024)")
    r.add_argument("--profile-tokens", type=number(1, 100_000, integer=True), default=64, help="tokens per decode probe (default: %(default)s)")
    r.add_argument("--tokenizer", help="for profile prompts: GGUF, HF dir or 'whitespace' (default: the default GGUF)")

    o = p.add_argument_group("output")
    o.add_argument("--explain", action="store_true", help="walk the arithmetic step by step instead of the tables")
    o.add_argument("--json", type=Path, metavar="PATH", help="also write the plan as JSON here; '-' prints only the JSON")
