"""Cluster throughput with tracing on vs off, alternating on/off/on/off in
one run (a fresh cluster each time; replicas inherit PDCLUSTER_TRACING).

    python -m bench.load.tracing_overhead [--duration 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys

from bench.fingerprint import print_fingerprint
from bench.load.loadgen import run_workload
from bench.tokenizer import load_tokenizer
from bench.workload import load_workload
from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.cli.cluster_runtime import LocalCluster
from pdcluster.services.config import ClusterConfig, PoolConfig


def throughput(tracing: bool, workload, tokenizer) -> float:
    os.environ["PDCLUSTER_TRACING"] = "1" if tracing else "0"
    pool = PoolConfig(num_cpus=1, num_threads=1, kv_cache_mib=256, max_queue=64)
    cluster = LocalCluster(ClusterConfig(prefill=pool, decode=pool, port=free_service_port()), num_cpus=8,
                           dashboard=False).start(progress=lambda m: None)
    try:
        url = f"http://127.0.0.1:{cluster.config.port}"
        warm = workload.model_copy(update={"stop": workload.stop.model_copy(update={"duration_s": 5.0})})
        asyncio.run(run_workload(url, warm, tokenizer, show_progress=False))
        result = asyncio.run(run_workload(url, workload, tokenizer, label=f"tracing {'on' if tracing else 'off'}"))
    finally:
        cluster.stop()
    ok = [r for r in result.records if r.ok]
    return sum(r.output_tokens for r in ok) / result.duration_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    print_fingerprint()
    workload = load_workload("steady")
    workload = workload.model_copy(update={"stop": workload.stop.model_copy(update={"duration_s": args.duration})})
    print("# output tok/s of a 1 prefill + 1 decode cluster, tracing on (JSONL exporter) vs off, "
          f"closed loop concurrency 8, 128 in / 64 out, {args.duration:.0f} s per run, alternating")
    print(f"# reproduce: python -m bench.load.tracing_overhead --duration {args.duration:.0f} --rounds {args.rounds}")
    tokenizer = load_tokenizer(None)
    on, off = [], []
    for i in range(args.rounds):
        for tracing in (True, False):
            tps = throughput(tracing, workload, tokenizer)
            (on if tracing else off).append(tps)
            print(f"round {i + 1} tracing {'on ' if tracing else 'off'}: {tps:.1f} output tok/s", flush=True)
    overhead = 1 - statistics.mean(on) / statistics.mean(off)
    print(f"mean on {statistics.mean(on):.1f} tok/s, off {statistics.mean(off):.1f} tok/s")
    print(f"target tracing_overhead: {overhead * 100:.1f}% (goal <= 3%) {'met' if overhead <= 0.03 else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
