"""Where a lone stream's time per output token goes: the engine alone against
the same engine behind a bare ``pdcluster up`` (issue 34's (b) row: TPOT p50
at concurrency 1, where llama.cpp's C++ server came within 6% of us).

    engine alone   the engine a bare `pdcluster up` decodes with here (its
                   pool's config and compute threads), in this process: a
                   step's median time while one 256-token prompt decodes 128
                   greedy tokens
    cluster        a bare `pdcluster up`: the same prompts streamed one at a
                   time through its OpenAI API (our load generator's client
                   path: one connection a request), the mean gap between
                   chunks per request; and the CPU its processes spent per
                   streamed token, from /proc: the gateway replica's, and the
                   engine replica's outside its compute threads (all but its
                   ``compute threads`` busiest threads)

The difference is the serving path's share of a token: what the gateway and
the replica's event loop do per token runs on the cores the engine computes
on.  One after the other, the engine first (its memory freed before the
cluster starts); nothing else may run meanwhile.  No targets: issue 34's
(b) target is vs_peer's.

    python -m bench.load.serving_overhead [--requests 8] [--port 8000] [--vs-serve-streaming [--rounds 2]]

``--vs-serve-streaming`` adds the cluster with ``token_channel: false`` (every token a Serve streaming
item), alternating with the default: what the token channel saves a token.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.fingerprint import print_fingerprint
from bench.load.servers import OurServer
from bench.machine_load import OtherLoad
from pdcluster.prefix_store.redis_server import free_service_port

PROMPT_TOKENS, OUTPUT_TOKENS = 256, 128
COMMAND = "python -m bench.load.serving_overhead"


def prompt(i: int, vocab: int = 40000) -> list[int]:
    """The i-th request's prompt: real token ids, different per request (no prefix hits)."""
    return [(7919 * t + 131 * i + 17) % vocab + 500 for t in range(PROMPT_TOKENS)]


def engine_alone_step_s(requests: int) -> tuple[float, int, str]:
    """Median decode step (seconds) of the default layout's decoding engine, its compute threads, its pool."""
    from pdcluster.services.cli.default_layout import default_layout, usable_cores
    from pdcluster.services.config import ClusterConfig
    from pdcluster.services.engine.engine import Engine
    from pdcluster.services.sampling_params import greedy

    cluster = ClusterConfig.model_validate(default_layout(usable_cores()))
    pool_name = "colocated" if cluster.mode == "colocated" else "decode"
    pool = getattr(cluster, pool_name)
    engine = Engine(dataclasses.replace(cluster.engine_config(pool), enable_prefix_caching=False))
    engine.set_compute_threads(pool.num_threads)
    steps: list[float] = []
    for i in range(requests + 1):  # the first warms up
        engine.add_request(f"alone-{i}", prompt(i), dataclasses.replace(greedy(OUTPUT_TOKENS), ignore_eos=True))
        times = []
        while engine.has_unfinished():
            engine.step()
            times.append(time.perf_counter())
        if i:
            steps += [b - a for a, b in zip(times[1:], times[2:])]  # decode steps only
    engine.close()
    del engine
    gc.collect()
    return statistics.median(steps), pool.num_threads, pool_name


def thread_cpu_s(procs) -> dict[tuple[int, int], float]:
    """CPU seconds (user + system) of every thread of ``procs`` (psutil processes), by (pid, tid)."""
    import psutil

    out = {}
    for proc in procs:
        try:
            out.update({(proc.pid, t.id): t.user_time + t.system_time for t in proc.threads()})
        except psutil.Error:
            pass  # the process ended: its threads count for nothing
    return out


def replicas(server: OurServer, pool: str) -> list:
    """The Serve replica processes of ``pool`` (ServeReplica:pdcluster:POOL) in this run's cluster's process tree."""
    import psutil

    found = []
    for proc in psutil.Process(server.pid).children(recursive=True):
        try:
            if f"ServeReplica:pdcluster:{pool}" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def stream_tpot_s(url: str, model: str, i: int) -> tuple[float, int]:
    """One streamed completion: the mean gap between its chunks, and how many chunks carried text."""
    body = {"model": model, "prompt": prompt(i), "max_tokens": OUTPUT_TOKENS, "stream": True, "temperature": 0,
            "ignore_eos": True}
    times = []
    with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"stream {i} carried {len(times)} chunk(s): no gap between chunks to time")
    return (times[-1] - times[0]) / (len(times) - 1), len(times)


@dataclasses.dataclass(frozen=True)
class ClusterFigures:
    tpot_s: float          # the median over streams of the mean gap between chunks
    chunks: int
    gateway_cpu_s: float   # per streamed chunk
    serving_cpu_s: float   # the engine replica's, beside its compute threads, per streamed chunk
    other_cores: float


def measure_cluster(config: Path | None, requests: int, pool: str, threads: int, port: int,
                    tmp: Path) -> ClusterFigures:
    """``requests`` lone streams through ``pdcluster up [--config config]`` and the CPU they cost."""
    server = OurServer(config, port, tmp / "up.log")
    server.start()
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        stream_tpot_s(server.url, model, 0)  # warm-up
        gateway, engines = replicas(server, "gateway"), replicas(server, pool)
        if not gateway or not engines:
            raise RuntimeError(f"no gateway or {pool} replica in the cluster's process tree")
        other = OtherLoad().start()
        before = thread_cpu_s(gateway + engines)
        tpots, chunks = [], 0
        for i in range(1, requests + 1):
            tpot, n = stream_tpot_s(server.url, model, i)
            tpots.append(tpot)
            chunks += n
        after = thread_cpu_s(gateway + engines)
        other_cores = other.cores()
    finally:
        server.stop()
    spent = {key: after[key] - before.get(key, 0.0) for key in after}
    gateway_pids, engine_pids = {p.pid for p in gateway}, {p.pid for p in engines}
    gateway_s = sum(s for (pid, _), s in spent.items() if pid in gateway_pids)
    engine_threads = sorted((s for (pid, _), s in spent.items() if pid in engine_pids), reverse=True)
    serving_s = sum(engine_threads[threads:])
    return ClusterFigures(statistics.median(tpots), chunks, gateway_s / chunks, serving_s / chunks, other_cores)


def print_cluster(name: str, f: ClusterFigures, step_s: float, requests: int, threads: int) -> None:
    print(f"{name}: TPOT median {f.tpot_s * 1e3:.2f} ms over {requests} streams ({f.chunks} chunks); "
          f"cluster TPOT - engine step = {(f.tpot_s - step_s) * 1e3:.2f} ms ({f.tpot_s / step_s:.2f}x the engine "
          f"alone); CPU per streamed token: the gateway replica {f.gateway_cpu_s * 1e3:.2f} ms, the engine replica "
          f"beside its {threads} compute threads {f.serving_cpu_s * 1e3:.2f} ms "
          f"(other processes: {f.other_cores:.2f} cores)", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="streams timed on each side (after one warm-up)")
    ap.add_argument("--port", type=int, default=0, help="the cluster's port (default: a free one)")
    ap.add_argument("--vs-serve-streaming", action="store_true",
                    help="also time the cluster with `token_channel: false` (every token through Serve's "
                         "streaming), alternating with the default for --rounds rounds")
    ap.add_argument("--rounds", type=int, default=1, help="cluster runs of each kind (with --vs-serve-streaming)")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests {args.requests}: time at least 1 stream")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: run at least 1 round")
    if not 0 <= args.port <= 65535:
        ap.error(f"--port {args.port}: a TCP port is 0 (a free one) to 65535")
    print_fingerprint()
    against = " and with every token through Serve's streaming (token_channel: false), alternating" \
        if args.vs_serve_streaming else ""
    print(f"# compares: a lone stream ({PROMPT_TOKENS} in / {OUTPUT_TOKENS} out, greedy) -- the engine alone vs "
          f"behind a bare `pdcluster up`{against}, one after the other", flush=True)
    extra = f" --vs-serve-streaming --rounds {args.rounds}" if args.vs_serve_streaming else ""
    print(f"# reproduce: {COMMAND} --requests {args.requests}{extra}", flush=True)
    step_s, threads, pool = engine_alone_step_s(args.requests)
    print(f"engine alone ({pool} pool's engine, {threads} compute threads): decode step median {step_s * 1e3:.2f} ms",
          flush=True)
    port = args.port or free_service_port()
    kinds = [("cluster (bare `pdcluster up`)", None)]
    with tempfile.TemporaryDirectory(prefix="serving-overhead-") as tmp:
        if args.vs_serve_streaming:
            off = Path(tmp) / "serve-streaming.yaml"
            off.write_text("token_channel: false\n")
            kinds.append(("cluster, token_channel: false", off))
        figures: dict[str, list[ClusterFigures]] = {name: [] for name, _ in kinds}
        for _ in range(args.rounds if args.vs_serve_streaming else 1):
            for name, config in kinds:
                f = measure_cluster(config, args.requests, pool, threads, port, Path(tmp))
                figures[name].append(f)
                print_cluster(f"{name}, {pool} pool", f, step_s, args.requests, threads)
    if args.vs_serve_streaming:
        (on_name, _), (off_name, _) = kinds
        on = statistics.median(f.tpot_s for f in figures[on_name])
        off_ = statistics.median(f.tpot_s for f in figures[off_name])
        cpu_on = statistics.median(f.gateway_cpu_s + f.serving_cpu_s for f in figures[on_name])
        cpu_off = statistics.median(f.gateway_cpu_s + f.serving_cpu_s for f in figures[off_name])
        print(f"token channel vs Serve streaming: TPOT {on * 1e3:.2f} vs {off_ * 1e3:.2f} ms ({on / off_:.2f}x); "
              f"serving CPU per token {cpu_on * 1e3:.2f} vs {cpu_off * 1e3:.2f} ms ({cpu_on / cpu_off:.2f}x)",
              flush=True)


if __name__ == "__main__":
    main()
