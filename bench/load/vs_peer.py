"""pdcluster vs the vLLM-CPU reference on the same cores, end to end through
each server's own OpenAI API, driven identically by our load generator.

One server runs at a time; the order alternates (ours, vLLM, ours, vLLM for
``--rounds 2``) and each figure is the median over rounds.  Workloads (greedy,
ignore EOS, prompts of real tokens from the same seed for both):

    a  256 in / 128 out, 16 concurrent       output tok/s
    b  256 in / 128 out, 1 at a time         output tok/s, TPOT p50
    c  1024 in / 32 out, 8 concurrent        output tok/s, TTFT p50

plus launch-to-ready seconds and resident memory (RSS summed over each
server's process tree, after its runs).  Needs ``vllm-cpu.sh setup`` once
(done here when missing: ~4 GB).  An extra column races our cluster with
``weight_dtype: int8`` (``--int8-config``, deploy/race_int8.yaml; issue 35)
against the same vLLM (bf16) runs; ``--no-int8`` leaves it out.  The targets
stay bf16's.

    python -m bench.load.vs_peer [--rounds 2] [--config deploy/race.yaml] [--int8-config deploy/race_int8.yaml]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.fingerprint import print_fingerprint
from bench.load.loadgen import run_workload
from bench.load.report import metric_samples
from bench.load.servers import REPO, OurServer, PeerServer
from bench.tokenizer import load_tokenizer
from bench.workload import Workload
from pdcluster.prefix_store.redis_server import free_service_port


def workload(name: str, input_tokens: int, output_tokens: int, concurrency: int, num_requests: int) -> Workload:
    return Workload.model_validate({
        "name": name, "seed": 7,
        "buckets": [{"name": name, "share": 1.0, "input_tokens": {"dist": "fixed", "value": input_tokens},
                     "output_tokens": {"dist": "fixed", "value": output_tokens}}],
        "arrival": {"kind": "closed", "concurrency": concurrency},
        "stop": {"num_requests": num_requests},
        "request": {"endpoint": "completions", "temperature": 0.0, "ignore_eos": True, "timeout_s": 600},
    })


WORKLOADS = {
    "a": workload("a_256in_128out_c16", 256, 128, 16, 48),
    "b": workload("b_256in_128out_c1", 256, 128, 1, 6),
    "c": workload("c_1024in_32out_c8", 1024, 32, 8, 24),
}
WARMUP = workload("warmup", 64, 8, 4, 8)


@dataclass
class Measured:
    tok_s: dict[str, list[float]] = field(default_factory=dict)
    tpot_p50_b: list[float] = field(default_factory=list)
    ttft_p50_c: list[float] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)
    rss_gib: list[float] = field(default_factory=list)
    errors: int = 0


def run_round(server, tokenizer, into: Measured) -> None:
    print(f"... {server.name}: launching", file=sys.stderr, flush=True)
    server.start()
    into.ready_s.append(server.launch_to_ready_s)
    print(f"... {server.name}: ready in {server.launch_to_ready_s:.1f} s", file=sys.stderr, flush=True)
    try:
        asyncio.run(run_workload(server.url, WARMUP, tokenizer, show_progress=False))
        for key, wl in WORKLOADS.items():
            result = asyncio.run(run_workload(server.url, wl, tokenizer, label=f"{server.name} {key}"))
            recs = result.records
            into.errors += sum(not r.ok for r in recs)
            into.tok_s.setdefault(key, []).append(sum(r.output_tokens for r in recs if r.ok) / result.duration_s)
            if key == "b":
                into.tpot_p50_b.append(statistics.median(metric_samples(recs, "tpot")))
            if key == "c":
                into.ttft_p50_c.append(statistics.median(metric_samples(recs, "ttft")))
        into.rss_gib.append(server.rss_bytes() / 2**30)
    finally:
        server.stop()


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def target(name: str, measured: float, op: str, goal: float) -> str:
    ok = measured >= goal if op == ">=" else measured <= goal
    return f"target {name}: {measured:.2f} (goal {op} {goal}) {'met' if ok else 'missed'}"


def print_int8_rows(i: Measured, v: Measured) -> None:
    """The weight_dtype int8 column: our int8 cluster against the same vLLM (bf16) runs."""
    print(f"\n{'weight_dtype int8':34} | {'ours int8':>10} | {'vLLM':>10} | {'int8/vLLM':>9}")
    rows = [("(a) 256/128 c16 output tok/s", med(i.tok_s["a"]), med(v.tok_s["a"])),
            ("(b) TPOT p50 ms", 1e3 * med(i.tpot_p50_b), 1e3 * med(v.tpot_p50_b)),
            ("(c) 1024/32 c8 output tok/s", med(i.tok_s["c"]), med(v.tok_s["c"])),
            ("(c) TTFT p50 ms", 1e3 * med(i.ttft_p50_c), 1e3 * med(v.ttft_p50_c)),
            ("resident memory GiB (process tree RSS)", med(i.rss_gib), med(v.rss_gib))]
    for label, ours_v, theirs in rows:
        print(f"{label:34} | {ours_v:10.1f} | {theirs:10.1f} | {ours_v / theirs:8.2f}x")
    print(f"# int8 request errors: {i.errors}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="alternations ours/vLLM (>= 2 for the record)")
    ap.add_argument("--config", default=str(REPO / "deploy" / "race.yaml"), help="our cluster's config")
    ap.add_argument("--peer-script", default=str(REPO.parent / "shared" / "peer" / "vllm-cpu.sh"))
    ap.add_argument("--int8-config", default=str(REPO / "deploy" / "race_int8.yaml"),
                    help="our cluster with weight_dtype int8: the extra column")
    ap.add_argument("--no-int8", action="store_true", help="race bf16 only")
    args = ap.parse_args(argv)
    print_fingerprint()
    print(f"# pdcluster ({Path(args.config).name}) vs vLLM-CPU 0.32 (vllm-cpu.sh), SmolLM2-135M-Instruct bf16, "
          f"same 2 cores, one server at a time, {args.rounds} alternations")
    print(f"# reproduce: python -m bench.load.vs_peer --rounds {args.rounds} --config {args.config}"
          + (" --no-int8" if args.no_int8 else f" --int8-config {args.int8_config}"))
    ours = OurServer(Path(args.config), free_service_port(), REPO / "runs" / "vs_peer_ours.log")
    ours.log.parent.mkdir(parents=True, exist_ok=True)
    ours_int8 = None if args.no_int8 else OurServer(Path(args.int8_config), free_service_port(),
                                                     REPO / "runs" / "vs_peer_ours_int8.log", name="pdcluster int8")
    peer = PeerServer(Path(args.peer_script), free_service_port())
    peer.setup()
    tokenizer = load_tokenizer(None)
    results = {"ours": Measured(), "vllm": Measured(), "int8": Measured()}
    for r in range(args.rounds):
        print(f"... round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        run_round(ours, tokenizer, results["ours"])
        if ours_int8 is not None:
            run_round(ours_int8, tokenizer, results["int8"])
        run_round(peer, tokenizer, results["vllm"])
    o, v = results["ours"], results["vllm"]

    print(f"\n{'':34} | {'pdcluster':>10} | {'vLLM':>10} | {'ours/vLLM':>9}")
    rows = [(f"(a) 256/128 c16 output tok/s", med(o.tok_s["a"]), med(v.tok_s["a"])),
            (f"(b) 256/128 c1 output tok/s", med(o.tok_s["b"]), med(v.tok_s["b"])),
            (f"(b) TPOT p50 ms", 1e3 * med(o.tpot_p50_b), 1e3 * med(v.tpot_p50_b)),
            (f"(c) 1024/32 c8 output tok/s", med(o.tok_s["c"]), med(v.tok_s["c"])),
            (f"(c) TTFT p50 ms", 1e3 * med(o.ttft_p50_c), 1e3 * med(v.ttft_p50_c)),
            ("launch to ready s", med(o.ready_s), med(v.ready_s)),
            ("resident memory GiB (process tree RSS)", med(o.rss_gib), med(v.rss_gib))]
    for label, ours_v, theirs in rows:
        print(f"{label:34} | {ours_v:10.1f} | {theirs:10.1f} | {ours_v / theirs:8.2f}x")
    for key in WORKLOADS:
        print(f"# {key} per round, tok/s: ours {[round(x) for x in o.tok_s[key]]}, vLLM {[round(x) for x in v.tok_s[key]]}")
    print(f"# request errors: ours {o.errors}, vLLM {v.errors}")
    if ours_int8 is not None:
        print_int8_rows(results["int8"], v)
    if o.errors or v.errors:
        print("# WARNING: failed requests are left out of tok/s, so a figure above counts only what was served; "
              "see runs/vs_peer_ours.log and the peer's log for why")
    print(target("a_c16_tok_s_ratio", med(o.tok_s["a"]) / med(v.tok_s["a"]), ">=", 1.2))
    print(target("b_c1_tpot_p50_ratio", med(o.tpot_p50_b) / med(v.tpot_p50_b), "<=", 1.0))
    print(target("c_c8_tok_s_ratio", med(o.tok_s["c"]) / med(v.tok_s["c"]), ">=", 1.0))
    print(target("launch_to_ready_ratio", med(o.ready_s) / med(v.ready_s), "<=", 0.5))
    return 0


if __name__ == "__main__":
    sys.exit(main())
