"""pdcluster vs vLLM-CPU and llama.cpp on the same cores, end to end through
each server's own OpenAI API, driven identically by our load generator.

Ours is what a bare ``pdcluster up`` starts (no config: the layout measured
best for the machine, services/cli/default_layout.py -- one colocated replica
on 2 cores or fewer, else 1 prefill + 1 decode; SLO admission on), issue 34.  The peers: vLLM-CPU 0.32
bf16 (``../shared/peer/vllm-cpu.sh``) and llama.cpp's llama-server bf16
(``../shared/peer/llamacpp.sh``, 2 threads, 16 slots).  One server runs at a
time; every round runs each server once in the same order (ours, vLLM,
llama.cpp bf16, then the extras) and each figure is the median over rounds.
Workloads (greedy, ignore EOS, the same prompts of real tokens from one seed):

    a  256 in / 128 out, 16 concurrent       output tok/s
    b  256 in / 128 out, 1 at a time         output tok/s, TPOT p50
    c  1024 in / 32 out, 8 concurrent        output tok/s, TTFT p50

plus launch-to-ready seconds and resident memory (RSS summed over each
server's process tree, after its runs).  Every request opens its own
connection, for every server alike (llama-server closed kept-alive
connections as the client reused them, failing requests).  Failed and refused
requests (our admission answers 429 when the predicted TTFT passes 2 s) are
counted per server and workload and never count as throughput.

Extra columns, each optional: ``--tuned-config deploy/race.yaml`` (a tuned
config, its own column, no targets); ``--baseline CHECKOUT`` (another
commit's bare ``pdcluster up`` from its own checkout and .venv: before/after
in one run, no targets); ours with ``--weight-dtype int8``
(issue 35; ``--no-int8``; in the tuned config when there is one, so that it
compares weights on the same admitted load) against vLLM bf16 and llama.cpp Q8_0; llama.cpp
q4_1 (what its users run; ``--no-q4-1``) and Q8_0 (made here from the bf16
GGUF with the built llama-quantize; ``--no-q8-0``).  A peer that is not
installed or does not start is skipped with its reason, and its targets print
as ``n/a ... missed``.  The targets are issue 34's, for the default cluster.

    python -m bench.load.vs_peer [--rounds 2] [--tuned-config deploy/race.yaml] [--no-llamacpp] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench.fingerprint import print_fingerprint
from bench.load.llamacpp_server import LlamaCppServer, ensure_q8_0, llamacpp_dir, missing_reason
from bench.load.loadgen import run_workload
from bench.load.race_table import (TARGETS_VS_LLAMACPP, TARGETS_VS_VLLM, Measured, failure_line, race_order,
                                   ratio_table, ratios, server_table, summarize, target_lines)
from bench.load.report import metric_samples
from bench.load.servers import REPO, OurServer, PeerServer
from bench.tokenizer import load_tokenizer
from bench.workload import Workload
from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.cli.default_layout import default_mode

SHARED_PEER = REPO.parent / "shared" / "peer"
# (ratio column, numerator, denominator), printed when both ran
COMPARISONS = (("ours/vLLM", "ours", "vLLM"), ("ours/llama.cpp bf16", "ours", "llama.cpp bf16"),
               ("ours/llama.cpp q4_1", "ours", "llama.cpp q4_1"), ("tuned/vLLM", "ours tuned", "vLLM"),
               ("int8/vLLM", "ours int8", "vLLM"), ("int8/llama.cpp q8_0", "ours int8", "llama.cpp q8_0"),
               ("ours/baseline", "ours", "baseline"), ("baseline/vLLM", "baseline", "vLLM"),
               ("baseline/llama.cpp bf16", "baseline", "llama.cpp bf16"))


def workload(name: str, input_tokens: int, output_tokens: int, concurrency: int, num_requests: int) -> Workload:
    return Workload.model_validate({
        "name": name, "seed": 7,
        "buckets": [{"name": name, "share": 1.0, "input_tokens": {"dist": "fixed", "value": input_tokens},
                     "output_tokens": {"dist": "fixed", "value": output_tokens}}],
        "arrival": {"kind": "closed", "concurrency": concurrency},
        "stop": {"num_requests": num_requests},
        "request": {"endpoint": "completions", "temperature": 0.0, "ignore_eos": True, "timeout_s": 600},
    })


def race_workloads(scale: float = 1.0) -> dict[str, Workload]:
    """The three workloads; ``scale`` < 1 sends fewer requests (at least 1 each), same shapes."""
    n = lambda full: max(1, math.ceil(full * scale))  # noqa: E731
    return {"a": workload("a_256in_128out_c16", 256, 128, 16, n(48)),
            "b": workload("b_256in_128out_c1", 256, 128, 1, n(6)),
            "c": workload("c_1024in_32out_c8", 1024, 32, 8, n(24))}


WARMUP = workload("warmup", 64, 8, 4, 8)


def run_round(server, tokenizer, workloads: dict[str, Workload], into: Measured) -> None:
    """Starts ``server``, runs the warm-up and each workload, records into ``into``, stops it.
    A server that does not start, or stops answering mid-run, is recorded with why (and skipped after)."""
    print(f"... {server.name}: launching", file=sys.stderr, flush=True)
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - any start failure is a row, not a crashed bench
        server.stop()
        into.failure = f"did not start: {exc}"
        print(f"... {server.name}: {into.failure}", file=sys.stderr, flush=True)
        return
    into.ready_s.append(server.launch_to_ready_s)
    print(f"... {server.name}: ready in {server.launch_to_ready_s:.1f} s", file=sys.stderr, flush=True)
    try:
        asyncio.run(run_workload(server.url, WARMUP, tokenizer, show_progress=False, fresh_connections=True))
        for key, wl in workloads.items():
            try:
                result = asyncio.run(run_workload(server.url, wl, tokenizer, label=f"{server.name} {key}",
                                                  fresh_connections=True))
            except RuntimeError as exc:  # the server stopped answering (run_workload could not list models)
                into.failure = f"stopped serving in ({key}): {exc}" + _log_tail(server)
                print(f"... {server.name}: {into.failure}", file=sys.stderr, flush=True)
                return
            record_workload(key, result.records, result.duration_s, into)
        into.rss_gib.append(server.rss_bytes() / 2**30)
    finally:
        server.stop()


def _log_tail(server) -> str:
    tail = getattr(server, "log_tail", None)
    return f"; log's last line: {tail()}" if tail else ""


def record_workload(key: str, records: list, duration_s: float, into: Measured) -> None:
    """Served output tokens per second; failures by kind; TPOT/TTFT p50 over served requests only."""
    served = [r for r in records if r.ok]
    into.failed.setdefault(key, Counter()).update(r.error for r in records if not r.ok)
    into.short[key] = into.short.get(key, 0) + sum(r.output_tokens < r.planned_output_tokens for r in served)
    into.tok_s.setdefault(key, []).append(sum(r.output_tokens for r in served) / duration_s if duration_s > 0 else 0.0)
    tpot, ttft = metric_samples(records, "tpot"), metric_samples(records, "ttft")
    if key == "b" and tpot:
        into.tpot_p50_b_s.append(statistics.median(tpot))
    if key == "c" and ttft:
        into.ttft_p50_c_s.append(statistics.median(ttft))


def contestants(args) -> tuple[list[tuple[str, object]], list[str]]:
    """(column name, server) in race order, and one note per server left out."""
    runs = REPO / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    chosen: list[tuple[str, object]] = [("ours", OurServer(None, free_service_port(), runs / "vs_peer_ours.log"))]
    skipped: list[str] = []
    if args.no_vllm:
        skipped.append("vLLM: left out (--no-vllm)")
    else:
        vllm = PeerServer(Path(args.peer_script), free_service_port())
        vllm.setup()
        chosen.append(("vLLM", vllm))
    llama = llamacpp_contestants(args)
    chosen += [(name, server) for name, server, _ in llama if name == "llama.cpp bf16" and server]
    if args.tuned_config:
        chosen.append(("ours tuned", OurServer(Path(args.tuned_config), free_service_port(),
                                                runs / "vs_peer_ours_tuned.log", name="pdcluster tuned")))
    if args.baseline:
        checkout = Path(args.baseline).resolve()
        chosen.append(("baseline", OurServer(None, free_service_port(), runs / "vs_peer_baseline.log",
                                             name=f"pdcluster baseline ({checkout.name})", checkout=checkout)))
    if not args.no_int8:
        named = args.int8_config or args.tuned_config
        config = Path(named) if named else None
        chosen.append(("ours int8", OurServer(config, free_service_port(), runs / "vs_peer_ours_int8.log",
                                               name="pdcluster int8", extra_args=("--weight-dtype", "int8"))))
    chosen += [(name, server) for name, server, _ in llama if name != "llama.cpp bf16" and server]
    skipped += [f"{name}: {why}" for name, server, why in llama if server is None]
    return chosen, skipped


def llamacpp_contestants(args) -> list[tuple[str, LlamaCppServer | None, str]]:
    """(column, server or None, why not) for each llama.cpp variant asked for."""
    peer_dir = llamacpp_dir()
    if args.no_llamacpp:
        return [("llama.cpp", None, "left out (--no-llamacpp)")]
    variants = ["bf16"] + ([] if args.no_q4_1 else ["q4_1"]) + ([] if args.no_q8_0 else ["q8_0"])
    out: list[tuple[str, LlamaCppServer | None, str]] = []
    for variant in variants:
        why = missing_reason(peer_dir, "bf16") or (ensure_q8_0(peer_dir) if variant == "q8_0" else None) \
            or missing_reason(peer_dir, variant)
        server = None if why else LlamaCppServer(Path(args.llamacpp_script), free_service_port(), variant, peer_dir)
        out.append((f"llama.cpp {variant}", server, why or ""))
    return out


def checkout_commit(checkout: Path) -> str:
    """``git describe``-like one line for a checkout: short hash and subject (or why not)."""
    done = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip()[:100] if done.returncode == 0 else f"not a git checkout: {done.stderr.strip()}"


def reproduce_command(args) -> str:
    flags = [f"--rounds {args.rounds}"]
    flags += [f"--tuned-config {shlex.quote(args.tuned_config)}"] if args.tuned_config else []
    flags += [f"--int8-config {shlex.quote(args.int8_config)}"] if args.int8_config else []
    flags += [f"--baseline {shlex.quote(args.baseline)}"] if args.baseline else []
    flags += [f"--{name.replace('_', '-')}" for name in ("no_vllm", "no_llamacpp", "no_int8", "no_q4_1", "no_q8_0",
                                                         "smoke") if getattr(args, name)]
    return "python -m bench.load.vs_peer " + " ".join(flags)


def report(results: dict[str, Measured], order: list[str]) -> None:
    summaries = {name: summarize(results[name]) for name in order if results[name].failure is None}
    print()
    for line in server_table([(name, summaries[name]) for name in order if name in summaries]):
        print(line)
    pairs = [(label, ratios(summaries[a], summaries[b])) for label, a, b in COMPARISONS
             if a in summaries and b in summaries]
    if pairs:
        print()
        for line in ratio_table(pairs):
            print(line)
    for name in order:
        m = results[name]
        per_round = "; ".join(f"{k} {[round(x) for x in m.tok_s.get(k, [])]}" for k in ("a", "b", "c"))
        print(failure_line(name, m) + ("" if m.failure else f"; tok/s per round: {per_round}"))
    if any(sum(sum(c.values()) for c in m.failed.values()) for m in results.values()):
        print("# failed/refused requests are left out of tok/s and latency: a figure counts only what was served "
              "(runs/vs_peer_*.log and the peers' serve.log say why)")
    ours = summaries.get("ours")
    for targets, peer in ((TARGETS_VS_VLLM, "vLLM"), (TARGETS_VS_LLAMACPP, "llama.cpp bf16")):
        both = ours is not None and peer in summaries
        for line in target_lines(targets, ratios(ours, summaries[peer]) if both else None):
            print(line)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every server in turn (>= 2 for the record)")
    ap.add_argument("--tuned-config", help="a tuned cluster config raced as its own column (e.g. deploy/race.yaml)")
    ap.add_argument("--int8-config", help="config for the int8 column (default: --tuned-config's, else none, i.e. "
                                          "`pdcluster up --weight-dtype int8`)")
    ap.add_argument("--baseline", metavar="CHECKOUT",
                    help="another checkout of pdcluster with its own .venv (e.g. `git worktree add ../before "
                         "COMMIT && make -C ../before setup`): its bare `pdcluster up` raced as column "
                         "'baseline', to compare two commits in one run (no targets)")
    ap.add_argument("--peer-script", default=str(SHARED_PEER / "vllm-cpu.sh"))
    ap.add_argument("--llamacpp-script", default=str(SHARED_PEER / "llamacpp.sh"))
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out")
    ap.add_argument("--no-llamacpp", action="store_true", help="leave every llama.cpp column out")
    ap.add_argument("--no-int8", action="store_true", help="leave out ours with --weight-dtype int8")
    ap.add_argument("--no-q4-1", action="store_true", help="leave out llama.cpp q4_1")
    ap.add_argument("--no-q8-0", action="store_true", help="leave out llama.cpp Q8_0")
    ap.add_argument("--smoke", action="store_true", help="a quarter of the requests: checks the columns work; "
                                                          "not a measurement")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print_fingerprint()
    chosen, skipped = contestants(args)
    order = [name for name, _ in chosen]
    layout = default_mode()
    print(f"# compares: ours = `pdcluster up` with no config ({layout} here, SLO admission on) against vLLM-CPU "
          f"0.32 bf16 and llama.cpp llama-server bf16 (2 threads, 16 slots); SmolLM2-135M-Instruct, the same cores, "
          f"one server at a time, {args.rounds} round(s) of: {', '.join(order)}")
    if "baseline" in order:
        print(f"# baseline = `pdcluster up` with no config from {Path(args.baseline).resolve()} "
              f"({checkout_commit(Path(args.baseline))})")
    if "ours int8" in order:
        int8 = args.int8_config or args.tuned_config
        print(f"# ours int8 = `pdcluster up --weight-dtype int8{f' --config {int8}' if int8 else ''}`")
    for note in skipped:
        print(f"# skipped {note}")
    print(f"# reproduce: {reproduce_command(args)}")
    if args.smoke:
        print("# SMOKE: a quarter of the requests; these figures are not a measurement")
    tokenizer = load_tokenizer(None)
    workloads = race_workloads(0.25 if args.smoke else 1.0)
    servers = dict(chosen)
    results = {name: Measured() for name in order}
    for r, name in race_order(order, args.rounds):
        if results[name].failure is None:
            print(f"... round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            run_round(servers[name], tokenizer, workloads, results[name])
    report(results, order)
    return 0


if __name__ == "__main__":
    sys.exit(main())
