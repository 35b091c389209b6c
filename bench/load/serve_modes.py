"""Disaggregated (1 prefill + 1 decode) vs colocated (2 replicas) on the same
CPU budget (2 replicas x 1 torch thread), one mixed workload, one run.
Disaggregated runs twice: every prompt through the prefill pool, and
conditionally (``router.local_prefill_max_tokens``: prompts up to 512
tokens prefilled on the decode replica, long ones on the prefill pool).

Prints TTFT and TPOT p50/p99 and goodput (requests with TTFT <= 2 s and
TPOT <= 100 ms) for every mode at each arrival rate, then the target lines,
judged at the last (highest) rate -- the load at which long prefills and
decodes contend for the same cores, which is what disaggregation is for --
for the disaggregated deployment with conditional disaggregation (the
configuration we recommend for this mix on a small CPU budget).  The pure
variant, every prompt through the one 1-thread prefill replica, is printed
as a reference: that replica saturates on the 2-3k-token prompts.
At a light load every mode meets the SLOs for most requests and goodput
ratios are bounded near 1 (at 1.5 req/s colocated already serves 82-86% of
requests within the SLOs, so no mode can reach 1.3x there).

    python -m bench.load.serve_modes [--duration 60] [--rates 1.5,3.0]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench.fingerprint import print_fingerprint
from bench.load.loadgen import run_workload
from bench.load.report import metric_samples
from bench.stats import summarize
from bench.tokenizer import load_tokenizer
from bench.workload import load_workload
from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.cli.cluster_runtime import LocalCluster
from pdcluster.services.config import ClusterConfig, PoolConfig, RouterSettings

TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.100
LOCAL_PREFILL_MAX_TOKENS = 512


def pool(**kw) -> PoolConfig:
    return PoolConfig(**({"num_cpus": 1, "num_threads": 1, "kv_cache_mib": 512, "max_queue": 256} | kw))


def configs() -> dict[str, ClusterConfig]:
    return {
        "disaggregated": ClusterConfig(mode="disaggregated", prefill=pool(), decode=pool(), port=free_service_port()),
        "disagg+local": ClusterConfig(mode="disaggregated", prefill=pool(), decode=pool(), port=free_service_port(),
                                      router=RouterSettings(local_prefill_max_tokens=LOCAL_PREFILL_MAX_TOKENS)),
        "colocated": ClusterConfig(mode="colocated", colocated=pool(num_replicas=2), port=free_service_port()),
    }


def good(record) -> bool:
    return record.ok and record.ttft_s is not None and record.ttft_s <= TTFT_SLO_S and \
        (record.tpot_s is None or record.tpot_s <= TPOT_SLO_S)


def run_mode(name: str, config: ClusterConfig, workload, tokenizer) -> dict:
    print(f"... {name}: starting the cluster", file=sys.stderr, flush=True)
    cluster = LocalCluster(config, num_cpus=8, dashboard=False).start(progress=lambda m: None)
    try:
        url = f"http://127.0.0.1:{cluster.config.port}"
        warm = workload.model_copy(update={"stop": workload.stop.model_copy(update={"duration_s": 5.0})})
        asyncio.run(run_workload(url, warm, tokenizer, show_progress=False))  # first-request costs
        result = asyncio.run(run_workload(url, workload, tokenizer, label=name))
    finally:
        cluster.stop()
    recs = result.records
    ttft, tpot = summarize(metric_samples(recs, "ttft")), summarize(metric_samples(recs, "tpot"))
    n_good = sum(good(r) for r in recs)
    return {"name": name, "requests": len(recs), "errors": sum(not r.ok for r in recs), "ttft": ttft, "tpot": tpot,
            "goodput_rps": n_good / result.duration_s, "good": n_good}


def print_table(rate: float, rows: list[dict]) -> None:
    print(f"\n# {rate} req/s")
    print(f"{'mode':<14} {'req':>4} {'err':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9} {'goodput':>12}")
    for r in rows:
        t, p = r["ttft"], r["tpot"]
        print(f"{r['name']:<14} {r['requests']:>4} {r['errors']:>4} {t.p50:>8.3f}s {t.p99:>8.3f}s "
              f"{p.p50 * 1e3:>7.1f}ms {p.p99 * 1e3:>7.1f}ms {r['goodput_rps']:>6.3f} req/s ({r['good']}/{r['requests']})",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--rates", default="1.5,3.0",
                    help="comma-separated arrival rates (req/s); the targets are judged at the last one")
    ap.add_argument("--modes", default=",".join(configs()), help="comma-separated subset (targets need all three)")
    args = ap.parse_args(argv)
    print_fingerprint()
    rates = [float(r) for r in args.rates.split(",")]
    print("# disaggregated (1 prefill + 1 decode) vs colocated (2 replicas), 1 torch thread per replica, "
          f"workload serve_modes at {', '.join(map(str, rates))} req/s for {args.duration:.0f} s each")
    print(f"# reproduce: python -m bench.load.serve_modes --duration {args.duration:.0f} --rates {args.rates}")
    tokenizer = load_tokenizer(None)
    modes = args.modes.split(",")
    rows: list[dict] = []
    for rate in rates:
        workload = load_workload("serve_modes")
        workload = workload.model_copy(update={
            "stop": workload.stop.model_copy(update={"duration_s": args.duration}),
            "arrival": workload.arrival.model_copy(update={"rate_rps": rate})})
        print(f"... {rate} req/s", file=sys.stderr, flush=True)
        rows = [run_mode(name, cfg, workload, tokenizer) for name, cfg in configs().items() if name in modes]
        print_table(rate, rows)
    by_name = {r["name"]: r for r in rows}
    if set(by_name) != set(configs()):
        print("# targets need all three modes")
        return 0
    print(f"\n# targets at {rates[-1]} req/s: the disaggregated deployment with conditional disaggregation")
    col = by_name["colocated"]

    def ratios(name: str) -> tuple[float, float]:
        dis = by_name[name]
        good = dis["goodput_rps"] / col["goodput_rps"] if col["goodput_rps"] else float("inf")
        return dis["tpot"].p99 / col["tpot"].p99, good

    tpot_ratio, good_ratio = ratios("disaggregated")
    print(f"# reference, every prompt through the prefill pool: TPOT p99 {tpot_ratio:.2f}x colocated, "
          f"goodput {good_ratio:.2f}x colocated")
    tpot_ratio, good_ratio = ratios("disagg+local")
    print(f"target tpot_p99_disagg_local_vs_colocated: {tpot_ratio:.2f} (goal <= 0.6) "
          f"{'met' if tpot_ratio <= 0.6 else 'missed'}")
    print(f"target goodput_disagg_local_vs_colocated: {good_ratio:.2f} (goal >= 1.3) "
          f"{'met' if good_ratio >= 1.3 else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
