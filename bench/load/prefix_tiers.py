"""KV tiers under the pool: tiers off vs on, one multi-turn chat workload
whose working set is 4x the KV pool, alternating in one run.

The working set is what the conversations in progress hold at the busiest
moment of the schedule (chat_sessions.live_tokens_peak): what a pool must
keep for every next turn to find its history.  Until 2026-12-07 the pool
was a quarter of every session's final context summed (``--working-set
footprint``), but sessions start and end at different times: at the
defaults the conversations in progress never held more than 2.2x that pool
(0.56 of the footprint), so one pool kept most live histories and tiers off
already hit much of them.

Each mode runs the same workload (bench/load/chat_sessions.py: Poisson
session starts, every turn's prompt the whole conversation so far) through
one replica's engine in real time -- requests join when their arrival time
comes, the engine steps meanwhile -- and counts the prompt tokens it had to
compute and each turn's TTFT (arrival to first token):

    off     prefix caching on the device pool only (what a replica did before)
    host    + a host-memory tier large enough for the working set
    disk    + a host tier the size of the pool, and a disk tier for the rest

The targets are judged on ``disk`` (most hits come from disk there).  Also
printed: what one block costs to bring back from each tier, beside what its
tokens cost to recompute (the off run's prefill seconds per token).

With ``--cluster 1p1d`` (1 prefill + 1 decode) or ``--cluster colocated``
(2 replicas) the same sessions go through the gateway of a local cluster
instead (bench/load/prefix_tiers_cluster.py), each replica's KV pool a
quarter of the working set: tiers and peer fetch off, vs tiers and peer
prefix fetch on (``--no-peer-fetch``: tiers alone), vs vLLM-CPU with prefix
caching on and a KV pool of one replica's tokens (``--no-vllm`` skips it).
Peer fetch belongs to the tiers-on row because in 1p1d the decode replica
generated each reply and alone caches its K/V, while the next turn, whose
prompt carries that reply, is prefilled by the prefill replica.

With ``--peer`` it measures peer prefix fetch instead
(bench/load/prefix_tiers_peer.py): on a local cluster of 2 prefill + 1
decode replicas, each session's turns run on prefill replica A and its last
turn is replica B's first request of the session: the share of that prompt
B computed (the rest pulled from A), judged against the issue's 0.2.

    python -m bench.load.prefix_tiers [--sessions 64 --turns 6 --repeats 1] [--cluster 1p1d]
    python -m bench.load.prefix_tiers --peer [--sessions 8 --turns 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.fingerprint import print_fingerprint
from bench.load.chat_sessions import ChatFrame, ChatWorkload, live_tokens_peak, make_sessions, next_prompt
from bench.targets import print_target
from pdcluster.services.engine.config import EngineConfig, KVTierConfig, SchedulerConfig
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.kv_disk_tier import read_record, write_record
from pdcluster.services.engine.model.loader import load_model
from pdcluster.services.sampling_params import SamplingParams

MODES = ("off", "host", "disk")
GOAL_PREFILL_RATIO, GOAL_TTFT_RATIO, GOAL_VLLM_RATIO, GOAL_PEER_SHARE = 0.4, 0.5, 0.5, 0.2


@dataclass
class RunResult:
    mode: str
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prefill_busy_s: float = 0.0       # seconds of steps that computed prompt tokens
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    tiers: object = None

    @property
    def ttft_p50_s(self) -> float:
        return float(np.median(self.ttft_s)) if self.ttft_s else float("nan")


def engine_for(mode: str, loaded, working_set: int, pool_blocks: int, block_bytes: int, tier_dir: Path,
               threads: int) -> Engine:
    """``working_set``, ``pool_blocks``: in blocks."""
    tiers = KVTierConfig()
    if mode == "host":
        tiers = KVTierConfig(enabled=True, host_bytes=2 * working_set * block_bytes)
    elif mode == "disk":
        tiers = KVTierConfig(enabled=True, host_bytes=pool_blocks * block_bytes, disk_dir=str(tier_dir),
                             disk_bytes=4 * working_set * (block_bytes + 4096))
    return Engine(EngineConfig(dtype="bfloat16", num_kv_blocks=pool_blocks, num_threads=threads, kv_tiers=tiers,
                               scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                                         prefill_chunk_size=512)), loaded=loaded)


def run(mode: str, engine: Engine, w: ChatWorkload, frame: ChatFrame) -> RunResult:
    """Drives the workload through ``engine`` in real time; returns what it computed and each TTFT."""
    system, sessions = make_sessions(w)
    params = SamplingParams(max_tokens=w.output_tokens, temperature=0, ignore_eos=True)
    res = RunResult(mode)
    due = sorted((s.start_s, s.index) for s in sessions)
    live: dict[str, tuple[int, float, list[int], list[int]]] = {}  # rid -> (session, arrival, prompt, output)
    total, done, next_report = w.sessions * w.turns, 0, 0.1
    t0 = time.monotonic()
    while due or live:
        now = time.monotonic() - t0
        while due and due[0][0] <= now:
            arrival, i = due.pop(0)
            s = sessions[i]
            prompt = next_prompt(system, frame, s)
            rid = f"s{i}t{s.turn}"
            engine.add_request(rid, prompt, params)
            live[rid] = (i, arrival, prompt, [])
            res.prompt_tokens += len(prompt)
        if not live:
            time.sleep(max(0.0, min(due[0][0] - now, 0.05)))
            continue
        before = engine.scheduler.num_prompt_tokens_computed
        t_step = time.monotonic()
        outs = engine.step()
        if engine.scheduler.num_prompt_tokens_computed > before:
            res.prefill_busy_s += time.monotonic() - t_step
        now = time.monotonic() - t0
        for o in outs:
            i, arrival, prompt, output = live[o.request_id]
            if not output and o.new_token_ids:
                res.ttft_s.append(now - arrival)
            output += o.new_token_ids
            if o.finished:
                if o.error:
                    raise RuntimeError(f"{o.request_id} failed: {o.error}")
                del live[o.request_id]
                s = sessions[i]
                s.history = prompt + output
                s.turn += 1
                done += 1
                if not s.done:
                    due.append((now + s.think_s[s.turn], i))
                    due.sort()
        if done / total >= next_report:
            print(f"... {mode}: {done}/{total} turns, {now:.0f} s", file=sys.stderr, flush=True)
            next_report += 0.1
    res.wall_s = time.monotonic() - t0
    st = engine.stats()
    res.prompt_tokens_computed = st.prompt_tokens_computed
    res.tiers = st.kv_tiers
    engine.check_integrity()
    return res


def block_costs_us(block_bytes: int, tier_dir: Path, reps: int = 50) -> tuple[float, float]:
    """Median microseconds to bring one block back: from host memory (a copy), from disk (read + verify + copy)."""
    src, dst = np.random.default_rng(0).integers(0, 255, size=block_bytes, dtype=np.uint8), np.empty(block_bytes,
                                                                                                   np.uint8)
    host, disk = [], []
    path = tier_dir / "probe.kvb"
    tokens = tuple(range(16))
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        host.append(time.perf_counter() - t)
        write_record(path, 1, 2, tokens, src)
        t = time.perf_counter()
        np.copyto(dst, read_record(path, 1, 2, 16, block_bytes).payload)
        disk.append(time.perf_counter() - t)
    path.unlink()
    return float(np.median(host)) * 1e6, float(np.median(disk)) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--rate", type=float, default=2.0, help="session starts per second (Poisson)")
    ap.add_argument("--think", type=float, default=15.0, help="mean seconds between a reply and the next turn")
    ap.add_argument("--pool-fraction", type=float, default=0.25, help="KV pool / working set")
    ap.add_argument("--working-set", choices=("live", "footprint"), default="live",
                    help="what the pool is a fraction of: the most K/V the conversations in progress hold at "
                         "one moment (live), or every session's final context summed (footprint, the sizing "
                         "before 2026-12-07)")
    ap.add_argument("--repeats", type=int, default=1, help="times each mode runs, alternating")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cluster", choices=("1p1d", "colocated"), default=None,
                    help="through the gateway of a local cluster of this shape (tiers off vs on)")
    ap.add_argument("--no-vllm", action="store_true", help="with --cluster: skip the vLLM-CPU row")
    ap.add_argument("--no-peer-fetch", action="store_true",
                    help="with --cluster: tiers on without peer prefix fetch (the replicas' own tiers only)")
    ap.add_argument("--peer-script", default=str(Path(__file__).resolve().parents[3] / "shared" / "peer" / "vllm-cpu.sh"),
                    help="with --cluster: vLLM-CPU's launcher (bench/load/servers.py PeerServer)")
    ap.add_argument("--peer", action="store_true",
                    help="peer prefix fetch on a 2 prefill + 1 decode cluster instead (prefix_tiers_peer.py)")
    args = ap.parse_args(argv)
    print_fingerprint()
    if args.peer:
        return run_peer_fetch(args)
    w = ChatWorkload(sessions=args.sessions, turns=args.turns, session_rate_rps=args.rate, think_s=args.think)
    loaded = load_model(None, "bfloat16")
    frame = ChatFrame.of(loaded.tokenizer)
    c = loaded.config
    block_bytes = c.num_layers * 2 * 16 * c.num_kv_heads * c.head_dim * 2  # bf16 pool
    ws_tokens = w.working_set_tokens(frame.num_tokens)  # the footprint: tiers are sized to hold it
    live_tokens = live_tokens_peak(w, make_sessions(w)[1], frame.num_tokens)
    sized_by = live_tokens if args.working_set == "live" else ws_tokens
    pool_blocks = max(int(sized_by * args.pool_fraction) // 16,
                      -(-(w.final_prompt_tokens(frame.num_tokens) + w.output_tokens) // 16))
    pool_tokens = pool_blocks * 16
    print(f"# workload: {w.sessions} sessions x {w.turns} turns, system {w.system_tokens} + {w.user_tokens} "
          f"tokens per user turn, {w.output_tokens} out, sessions start at {w.session_rate_rps}/s (Poisson), "
          f"think {w.think_s} s; the conversations in progress hold at most {live_tokens} tokens at once "
          f"= {live_tokens / pool_tokens:.1f}x the pool, every session's final context summed {ws_tokens} "
          f"= {ws_tokens / pool_tokens:.1f}x (pool: {pool_blocks} blocks of 16, "
          f"{pool_blocks * block_bytes / 2**20:.0f} MiB bf16, {args.pool_fraction:g} of the {args.working_set} set)")
    reproduce = (f"# reproduce: python -m bench.load.prefix_tiers --sessions {w.sessions} --turns {w.turns} "
                 f"--rate {w.session_rate_rps} --think {w.think_s} --pool-fraction {args.pool_fraction} "
                 f"--working-set {args.working_set} --repeats {args.repeats}")
    if args.cluster:
        on = "tiers on (host tier = the pool, disk tier for the rest)" + \
            ("" if args.no_peer_fetch else " + peer prefix fetch")
        print(f"# compares: a local cluster ({args.cluster}, 1 thread per replica, bf16) through its gateway, "
              f"tiers and peer fetch off vs {on}" + ("" if args.no_vllm else " vs vLLM-CPU (prefix caching on, "
                                                   "a KV pool of one replica's tokens)") + ", alternating")
        print(reproduce + f" --cluster {args.cluster}" + " --no-peer-fetch" * args.no_peer_fetch
              + " --no-vllm" * args.no_vllm)
        return run_clusters(args, w, frame, loaded.tokenizer, pool_blocks * block_bytes, pool_blocks * 16)
    print("# compares: one replica's engine (bf16, native kernels, "
          f"{args.threads} thread), tiers off vs on, alternating: {', '.join(args.modes.split(','))}")
    print(reproduce + f" --threads {args.threads}")
    results: dict[str, list[RunResult]] = {m: [] for m in args.modes.split(",")}
    with tempfile.TemporaryDirectory(prefix="prefix-tiers-", dir=Path("runs").resolve()
                                     if Path("runs").is_dir() else None) as tmp:
        host_us, disk_us = block_costs_us(block_bytes, Path(tmp))
        for rep in range(args.repeats):
            for mode in results:
                engine = engine_for(mode, loaded, ws_tokens // 16 + w.sessions, pool_blocks, block_bytes,
                                    Path(tmp) / f"{mode}-{rep}", args.threads)
                try:
                    r = run(mode, engine, w, frame)
                finally:
                    engine.close()
                results[mode].append(r)
                print_row(r)
    return report(results, host_us, disk_us)


def run_clusters(args, w: ChatWorkload, frame: ChatFrame, tokenizer, pool_bytes: int, pool_tokens: int) -> int:
    from bench.load.prefix_tiers_cluster import run_cluster, run_vllm

    kv_mib = max(1, -(-pool_bytes // 2**20))  # whole MiB, rounded up: the longest request must fit
    max_model_len = -(-(w.final_prompt_tokens(frame.num_tokens) + w.output_tokens + 64) // 128) * 128
    results: dict[str, list[RunResult]] = {"off": [], "disk": []} | ({} if args.no_vllm else {"vllm": []})
    with tempfile.TemporaryDirectory(prefix="prefix-tiers-", dir=Path("runs").resolve()
                                     if Path("runs").is_dir() else None) as tmp:
        for rep in range(args.repeats):
            for mode in results:
                if mode == "vllm":
                    ttfts, computed, flags = run_vllm(Path(args.peer_script), w, frame, tokenizer, pool_tokens,
                                                      max_model_len)
                    r = RunResult(mode, prompt_tokens_computed=computed, ttft_s=ttfts)
                    results[mode].append(r)
                    print(f"vLLM-CPU      : prompt tokens computed {computed}; TTFT p50 {r.ttft_p50_s:.3f} s, "
                          f"p90 {np.percentile(ttfts, 90):.3f} s; vllm serve {' '.join(flags)}", flush=True)
                    continue
                on = mode != "off"
                ttfts, per_replica, tiers = run_cluster(args.cluster, on, w, frame, tokenizer, kv_mib,
                                                        Path(tmp) / f"{mode}-{rep}", on and not args.no_peer_fetch)
                computed = sum(row["prompt_tokens_computed"] for row in per_replica.values())
                r = RunResult(mode, prompt_tokens_computed=computed, ttft_s=ttfts)
                results[mode].append(r)
                label = "off" if not on else "on " + ("" if args.no_peer_fetch else "+ peer fetch")
                print(f"{args.cluster} tiers {label}: prompt tokens computed "
                      f"{computed}; TTFT p50 {r.ttft_p50_s:.3f} s, p90 {np.percentile(ttfts, 90):.3f} s; "
                      f"replica tiers {tiers}", flush=True)
                for name, row in sorted(per_replica.items()):
                    print(f"#   {name}: {row}", flush=True)
    return report(results, float("nan"), float("nan"))


def run_peer_fetch(args) -> int:
    from bench.load.prefix_tiers_peer import run_peer

    w = ChatWorkload(sessions=args.sessions, turns=args.turns, session_rate_rps=args.rate, think_s=args.think)
    loaded = load_model(None, "bfloat16")
    print(f"# workload: {w.sessions} sessions x {w.turns} turns (system {w.system_tokens} + {w.user_tokens} "
          f"tokens per user turn, {w.output_tokens} out), one at a time; turns 1..{w.turns - 1} on prefill "
          f"replica A, turn {w.turns} on prefill replica B (its first of the session)")
    print("# compares: B's prompt tokens computed vs its prompt (the rest pulled from A), B's TTFT vs A's on a "
          "whole computed first turn; a local cluster, bf16, 1 thread per replica, peer_fetch on")
    print(f"# reproduce: python -m bench.load.prefix_tiers --peer --sessions {w.sessions} --turns {w.turns}")
    frame = ChatFrame.of(loaded.tokenizer)
    r = run_peer(w, frame)
    print(f"peer: B computed {r.computed_tokens} of {r.prompt_tokens} prompt tokens ({r.computed_share:.1%}); "
          f"TTFT p50 B {np.median(r.peer_ttft_s):.3f} s ({len(r.peer_ttft_s)} requests, "
          f"~{r.prompt_tokens / max(r.sessions, 1):.0f} prompt tokens each) vs A's first turns "
          f"{np.median(r.first_turn_ttft_s):.3f} s ({w.system_tokens + frame.num_tokens + w.user_tokens} tokens, "
          "all computed); "
          f"greedy tokens equal to A's on {r.same_tokens}/{r.sessions} sessions; B's counters {r.counters}",
          flush=True)
    nan = float("nan")
    print_target("prefill_tokens_tiers_on_vs_off", nan, "<=", GOAL_PREFILL_RATIO)
    print_target("ttft_p50_tiers_on_vs_off", nan, "<=", GOAL_TTFT_RATIO)
    print_target("ttft_p50_tiers_on_vs_vllm", nan, "<=", GOAL_VLLM_RATIO)
    print_target("peer_fetch_computed_share_of_prompt", r.computed_share, "<=", GOAL_PEER_SHARE)
    return 0 if r.same_tokens == r.sessions else 1


def print_row(r: RunResult) -> None:
    t = r.tiers
    tiers = "" if t is None else (f"; loaded {t.loaded_host_blocks} host + {t.loaded_disk_blocks} disk blocks, "
                                  f"{t.load_failures} refused, {t.spill_drops + t.host_full_drops} dropped")
    print(f"{r.mode:<5} prompt tokens {r.prompt_tokens}, computed {r.prompt_tokens_computed} "
          f"({r.prompt_tokens_computed / r.prompt_tokens:.0%}); TTFT p50 {r.ttft_p50_s:.3f} s, "
          f"p90 {np.percentile(r.ttft_s, 90):.3f} s; {r.wall_s:.0f} s{tiers}", flush=True)


def report(results: dict[str, list[RunResult]], host_us: float, disk_us: float) -> int:
    def total(mode: str, attr: str) -> float:
        return sum(getattr(r, attr) for r in results.get(mode, ()))

    def p50(mode: str) -> float:
        samples = [x for r in results.get(mode, ()) for x in r.ttft_s]
        return float(np.median(samples)) if samples else float("nan")

    nan = float("nan")
    per_token_us = total("off", "prefill_busy_s") / max(1, total("off", "prompt_tokens_computed")) * 1e6 \
        if "off" in results else nan
    if not np.isnan(host_us):
        print(f"# one block (16 tokens) back from host memory: {host_us:.0f} us, from disk (read + crc + copy): "
              f"{disk_us:.0f} us; recomputing it: {16 * per_token_us:.0f} us (off run: prefill step seconds / "
              "prompt tokens computed)")
    for on in ("host", "disk"):
        if on in results and "off" in results:
            print(f"# {on}: prefill tokens computed {total(on, 'prompt_tokens_computed') / total('off', 'prompt_tokens_computed'):.2f}x off, "
                  f"TTFT p50 {p50(on) / p50('off'):.2f}x off")
    ok = "off" in results and "disk" in results
    prefill_ratio = total("disk", "prompt_tokens_computed") / total("off", "prompt_tokens_computed") if ok else nan
    ttft_ratio = p50("disk") / p50("off") if ok else nan
    vllm_ratio = p50("disk") / p50("vllm") if "disk" in results and "vllm" in results else nan
    if "vllm" in results and "disk" in results:
        print(f"# vLLM-CPU: prefill tokens computed {total('vllm', 'prompt_tokens_computed'):.0f} "
              f"(tiers on {total('disk', 'prompt_tokens_computed') / max(1, total('vllm', 'prompt_tokens_computed')):.2f}x it), "
              f"TTFT p50 {p50('vllm'):.3f} s (tiers on {vllm_ratio:.2f}x it)")
    print("# targets judged on tiers on with a disk tier ('disk': host tier = the pool, disk tier for the rest); "
          "vLLM-CPU only with --cluster (else nan), peer fetch only with --peer (nan)")
    print_target("prefill_tokens_tiers_on_vs_off", prefill_ratio, "<=", GOAL_PREFILL_RATIO)
    print_target("ttft_p50_tiers_on_vs_off", ttft_ratio, "<=", GOAL_TTFT_RATIO)
    print_target("ttft_p50_tiers_on_vs_vllm", vllm_ratio, "<=", GOAL_VLLM_RATIO)
    print_target("peer_fetch_computed_share_of_prompt", nan, "<=", GOAL_PEER_SHARE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
