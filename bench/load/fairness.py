"""Many tenants, one cluster: one tenant floods while two others keep their SLO.

Three tenants share the default cluster (`pdcluster up`: 1 prefill + 1 decode
replica), each with its own API key:

    A   floods: short chats (~200 in / 48 out) at 5x the capacity measured first
    B   short chats (~100 in / 32 out), 0.3 requests/s, Poisson
    C   the same at 0.2 requests/s, priority -1 (more urgent; its tenant may ask it)

Two phases on the same cluster, one after the other:

    shares    each tenant with its own key: fair shares and classes at work
    off       the same traffic through one key and no priority: one tenant, first come first
              served, the SLO admission alone (what the cluster would do without tenants)

and, unless --no-peer, the same traffic against vLLM-CPU started with
``--scheduling-policy priority`` (C's requests carry priority -1 there too).

A request is good when served, TTFT <= 2 s and TPOT <= 100 ms.  A's share of
the remainder: A's served requests/s over (capacity - B's and C's rates).

    python -m bench.load.fairness [--duration 90] [--capacity RPS] [--no-peer]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.fingerprint import print_fingerprint
from bench.load.client import RequestRecord
from bench.load.loadgen import run_workload
from bench.load.mixed_goodput import is_good, TTFT_SLO_S, TPOT_SLO_S
from bench.load.servers import REPO, OurServer, PeerServer
from bench.targets import print_target
from bench.tokenizer import load_tokenizer
from bench.workload import Workload
from pdcluster.prefix_store.redis_server import free_service_port

B_RPS, C_RPS, FLOOD_X = 0.3, 0.2, 5.0


@dataclass(frozen=True)
class TenantResult:
    sent: int
    served: int
    refused: int
    good: int
    duration_s: float
    ttft_p50_s: float = float("nan")
    ttft_p90_s: float = float("nan")
    tpot_p50_s: float = float("nan")
    tpot_p90_s: float = float("nan")

    @property
    def goodput(self) -> float:
        return self.good / self.sent if self.sent else float("nan")

    @property
    def served_rps(self) -> float:
        return self.served / self.duration_s if self.duration_s else float("nan")


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


def tally(records: list[RequestRecord], duration_s: float) -> TenantResult:
    served = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in served if r.ttft_s is not None]
    tpots = [r.tpot_s for r in served if r.tpot_s is not None]
    return TenantResult(len(records), len(served), sum(r.error == "http_429" for r in records),
                        sum(is_good(r) for r in records), duration_s, _quantile(ttfts, 0.5), _quantile(ttfts, 0.9),
                        _quantile(tpots, 0.5), _quantile(tpots, 0.9))


def _workload(name: str, tokens_in: int, tokens_out: int, arrival: dict, stop: dict, seed: int,
              priority: int | None = None) -> Workload:
    return Workload.model_validate({
        "name": name, "seed": seed, "arrival": arrival, "stop": stop,
        "buckets": [{"name": name, "share": 1.0,
                     "input_tokens": {"dist": "normal", "mean": tokens_in, "std": tokens_in / 10, "min": 16},
                     "output_tokens": {"dist": "fixed", "value": tokens_out}}],
        "request": {"endpoint": "completions", "temperature": 0.0, "ignore_eos": True, "timeout_s": 300,
                    "priority": priority}})


def flood(rate_rps: float, duration_s: float, seed: int) -> Workload:
    return _workload("A_flood", 200, 48, {"kind": "poisson", "rate_rps": rate_rps}, {"duration_s": duration_s}, seed)


def chats(name: str, rate_rps: float, duration_s: float, seed: int, priority: int | None) -> Workload:
    return _workload(name, 100, 32, {"kind": "poisson", "rate_rps": rate_rps}, {"duration_s": duration_s}, seed,
                     priority)


def measure_capacity_rps(url: str, key: str, tokenizer, duration_s: float = 30.0) -> float:
    """A's requests completed per second by a closed loop of 8 (what the cluster sustains)."""
    probe = _workload("capacity", 200, 48, {"kind": "closed", "concurrency": 8}, {"duration_s": duration_s}, 3)
    result = asyncio.run(run_workload(url, probe, tokenizer, label="capacity", api_key=key))
    done = sum(r.ok for r in result.records)
    if not done:
        raise RuntimeError("the capacity probe completed no request: see the server's log")
    return done / result.duration_s


async def _phase(url: str, keys: dict[str, str], capacity: float, duration_s: float, tokenizer,
                 seed: int) -> dict[str, TenantResult]:
    loads = {"A": flood(FLOOD_X * capacity, duration_s, seed), "B": chats("B_chats", B_RPS, duration_s, seed + 1, None),
             "C": chats("C_urgent", C_RPS, duration_s, seed + 2, -1)}
    runs = await asyncio.gather(*(run_workload(url, w, tokenizer, label=f"{t}", api_key=keys[t])
                                  for t, w in loads.items()))
    return {t: tally(r.records, duration_s) for t, r in zip(loads, runs)}


def _config(keys: dict[str, str], operator_key: str) -> dict:
    return {"api_keys": [operator_key],
            "tenants": [{"name": "tenant-a", "api_keys": [keys["A"]]},
                        {"name": "tenant-b", "api_keys": [keys["B"]]},
                        {"name": "tenant-c", "api_keys": [keys["C"]], "min_priority": -1}]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of traffic per phase")
    ap.add_argument("--capacity", type=float, default=None, help="A's sustainable requests/s (default: measured)")
    ap.add_argument("--peer-script", default=str(REPO.parent / "shared" / "peer" / "vllm-cpu.sh"))
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    args = ap.parse_args(argv)
    print_fingerprint()
    print(f"# tenant A floods at {FLOOD_X:g}x capacity, B chats at {B_RPS} req/s, C urgent chats at {C_RPS} req/s "
          f"(priority -1); default cluster (1 prefill + 1 decode); SLO TTFT <= {TTFT_SLO_S} s, TPOT <= "
          f"{TPOT_SLO_S * 1e3:.0f} ms; {args.duration:g} s per phase", flush=True)
    tokenizer = load_tokenizer(None)
    keys = {t: f"sk-bench-{t.lower()}-{secrets.token_hex(12)}" for t in "ABC"}
    operator = f"sk-bench-op-{secrets.token_hex(12)}"
    results: dict[str, dict[str, TenantResult]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "tenants.yaml"
        config.write_text(yaml.safe_dump(_config(keys, operator)))
        (REPO / "runs").mkdir(exist_ok=True)
        ours = OurServer(config, free_service_port(), REPO / "runs" / "fairness_ours.log")
        print("... pdcluster: launching", file=sys.stderr, flush=True)
        ours.start()
        try:
            capacity = args.capacity or measure_capacity_rps(ours.url, keys["A"], tokenizer)
            print(f"# capacity: {capacity:.2f} A-requests/s (closed loop of 8); A floods at "
                  f"{FLOOD_X * capacity:.2f} req/s", flush=True)
            print(f"# reproduce: python -m bench.load.fairness --duration {args.duration:g} --capacity "
                  f"{capacity:.2f}{' --no-peer' if args.no_peer else ''}", flush=True)
            results["shares"] = asyncio.run(_phase(ours.url, keys, capacity, args.duration, tokenizer, 21))
            one = {t: keys["A"] for t in "ABC"}
            results["off"] = asyncio.run(_phase(ours.url, one, capacity, args.duration, tokenizer, 21))
        finally:
            ours.stop()
        if not args.no_peer:
            peer = PeerServer(Path(args.peer_script), free_service_port(), serve_args=("--scheduling-policy",
                                                                                      "priority"))
            peer.setup()
            print("... vLLM: launching", file=sys.stderr, flush=True)
            peer.start()
            try:
                results["vLLM"] = asyncio.run(_phase(peer.url, {t: "" for t in "ABC"}, capacity, args.duration,
                                                     tokenizer, 21))
            finally:
                peer.stop()
    print(f"\n{'run':7} | tenant | sent | served | 429 | good | goodput | served req/s | TTFT p50/p90 s | "
          "TPOT p50/p90 ms")
    for run, by_tenant in results.items():
        for t, r in by_tenant.items():
            print(f"{run:7} | {t:6} | {r.sent:4} | {r.served:6} | {r.refused:3} | {r.good:4} | {r.goodput:7.1%} | "
                  f"{r.served_rps:12.2f} | {r.ttft_p50_s:6.2f}/{r.ttft_p90_s:<6.2f} | "
                  f"{r.tpot_p50_s * 1e3:5.0f}/{r.tpot_p90_s * 1e3:.0f}")
    shares, off = results["shares"], results["off"]
    remainder = max(capacity - B_RPS - C_RPS, 1e-9)
    print_target("B_goodput", shares["B"].goodput, ">=", 0.95)
    print_target("C_goodput", shares["C"].goodput, ">=", 0.95)
    print_target("A_share_of_remainder", shares["A"].served_rps / remainder, ">=", 0.8)
    print_target("B_goodput_without_shares", off["B"].goodput, "<=", 0.5)
    print_target("C_goodput_without_shares", off["C"].goodput, "<=", 0.5)
    if "vLLM" in results:
        print_target("B_goodput_vs_vllm", shares["B"].goodput - results["vLLM"]["B"].goodput, ">=", 0.0)
        print_target("C_goodput_vs_vllm", shares["C"].goodput - results["vLLM"]["C"].goodput, ">=", 0.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
