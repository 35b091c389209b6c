"""bench.load.prefix_tiers through the gateway of a local cluster: the same
chat sessions sent as token-id prompts to ``/v1/completions`` (streamed),
TTFT taken at the client (send to first token), prompt tokens computed
summed over every replica's status-board counters (after minus before).
A turn's history is its prompt plus its reply re-encoded from the text the
server streamed, so reply tokens may split differently than generated.

    1p1d        1 prefill + 1 decode replica (the prefill replica prefills every prompt)
    colocated   2 colocated replicas (the cache-aware router places each turn)
    vllm        vLLM-CPU's OpenAI server (/work/shared/peer/vllm-cpu.sh), prefix caching
                on (passed explicitly), its KV pool as many tokens as one of our replicas'
                (``--num-gpu-blocks-override``, its CPU default block of 128 tokens), prompt
                tokens computed from its Prometheus counter (source="local_compute")
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

from bench.load.chat_sessions import ChatFrame, ChatWorkload, Session, make_sessions, next_prompt
from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import AdmissionSettings, ClusterConfig, KVTierSettings, PeerFetchSettings, PoolConfig
from pdcluster.services.pools.status_board import read_board

KINDS = ("1p1d", "colocated")


def cluster_config(kind: str, tiers_on: bool, kv_cache_mib: int, tier_dir: Path, peer_fetch: bool = False
                   ) -> ClusterConfig:
    """``peer_fetch``: a replica pulls the prefix a peer holds past its own (in 1p1d the decode replica holds
    each reply it generated, which the next turn's prompt carries)."""
    pool = PoolConfig(num_cpus=1, num_threads=1, kv_cache_mib=kv_cache_mib, max_queue=512, max_ongoing_requests=512)
    tiers = KVTierSettings(enabled=tiers_on, host_mib=kv_cache_mib, dir=str(tier_dir))
    common = dict(port=free_service_port(), kv_tiers=tiers, admission=AdmissionSettings(shed=False),
                  peer_fetch=PeerFetchSettings(enabled=peer_fetch))
    if kind == "1p1d":
        return ClusterConfig(mode="disaggregated", prefill=pool, decode=pool, **common)
    return ClusterConfig(mode="colocated", colocated=pool.model_copy(update={"num_replicas": 2}), **common)


async def _turn(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
                ) -> tuple[float, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.monotonic()
    ttft, text = None, []
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            piece = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
            if piece and ttft is None:
                ttft = time.monotonic() - t0
            text.append(piece)
    return (ttft if ttft is not None else float("nan")), "".join(text)


async def drive(url: str, model: str, w: ChatWorkload, frame: ChatFrame, tokenizer, label: str) -> list[float]:
    """Runs every session (Poisson starts, think times); returns each turn's TTFT."""
    system, sessions = make_sessions(w)
    ttfts: list[float] = []
    done = [0]
    total = w.sessions * w.turns

    async def session(s: Session, http: aiohttp.ClientSession, t0: float) -> None:
        await asyncio.sleep(max(0.0, s.start_s - (time.monotonic() - t0)))
        while not s.done:
            prompt = next_prompt(system, frame, s)
            ttft, text = await _turn(http, url, model, prompt, w.output_tokens)
            ttfts.append(ttft)
            s.history = prompt + tokenizer.encode(text)
            s.turn += 1
            done[0] += 1
            if done[0] % max(1, total // 10) == 0:
                print(f"... {label}: {done[0]}/{total} turns, {time.monotonic() - t0:.0f} s", file=sys.stderr,
                      flush=True)
            if not s.done:
                await asyncio.sleep(s.think_s[s.turn])

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.monotonic()
        await asyncio.gather(*(session(s, http, t0) for s in sessions))
    return ttfts


REPLICA_COUNTERS = ("prompt_tokens_computed", "prompt_tokens_cached")
WORKER_COUNTERS = ("requests", "prompt_tokens", "blocks_pulled", "peer_fetches", "peer_blocks_pulled",
                   "peer_fetch_failures", "peer_blocks_lent")


def replica_counters(cluster) -> dict[str, dict[str, int]]:
    """Each replica's prompt and pull counters so far (status board), by role and name."""
    out = {}
    for s in read_board(cluster.config.index_url, cluster.config.cluster_name):
        row = {k: s.get(k, 0) for k in REPLICA_COUNTERS}
        row |= {k: s.get("counters", {}).get(k, 0) for k in WORKER_COUNTERS}
        out[f"{s['role']}:{s['name']}"] = row
    return out


def counters_delta(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """``after - before`` per replica and counter (a replica absent before counts from zero)."""
    return {name: {k: v - before.get(name, {}).get(k, 0) for k, v in row.items()} for name, row in after.items()}


def board_wait_s() -> float:
    """Long enough for every replica to publish its status twice."""
    from pdcluster.services.pools import status_board
    return 2 * status_board._PERIOD_S + 0.5


def run_cluster(kind: str, tiers_on: bool, w: ChatWorkload, frame: ChatFrame, tokenizer, kv_cache_mib: int,
                tier_dir: Path, peer_fetch: bool = False):
    """(TTFTs, per-replica counters over the run, the replicas' tier views) of one cluster run."""
    from pdcluster.services.cli.cluster_runtime import LocalCluster

    label = f"{kind} tiers {'on' if tiers_on else 'off'}{' + peer fetch' if peer_fetch else ''}"
    print(f"... {label}: starting the cluster", file=sys.stderr, flush=True)
    config = cluster_config(kind, tiers_on, kv_cache_mib, tier_dir, peer_fetch)
    cluster = LocalCluster(config, num_cpus=8, dashboard=False).start(progress=lambda m: None)
    try:
        url = f"http://127.0.0.1:{config.port}"
        warm = ChatWorkload(sessions=2, turns=1, session_rate_rps=10.0, seed=99)
        asyncio.run(drive(url, config.served_model_name, warm, frame, tokenizer, "warm-up"))
        time.sleep(board_wait_s())
        before = replica_counters(cluster)
        ttfts = asyncio.run(drive(url, config.served_model_name, w, frame, tokenizer, label))
        time.sleep(board_wait_s())
        per_replica = counters_delta(before, replica_counters(cluster))
        tiers = [s.get("kv_tiers") for s in read_board(cluster.config.index_url, config.cluster_name)]
    finally:
        cluster.stop()
    return ttfts, per_replica, tiers


VLLM_MODEL = "smollm2-135m-instruct"   # vllm-cpu.sh's --served-model-name
VLLM_BLOCK_TOKENS = 128                # vLLM's CPU backend default block size


def vllm_serve_args(pool_tokens: int, max_model_len: int) -> tuple[str, ...]:
    """`vllm serve` flags for a KV pool of at least ``pool_tokens`` tokens (whole blocks), prefix caching on."""
    blocks = max(-(-pool_tokens // VLLM_BLOCK_TOKENS), -(-max_model_len // VLLM_BLOCK_TOKENS))
    return ("--enable-prefix-caching", "--block-size", str(VLLM_BLOCK_TOKENS), "--num-gpu-blocks-override",
            str(blocks), "--max-model-len", str(max_model_len))


def vllm_computed_tokens(metrics_text: str) -> int:
    """Prompt tokens vLLM computed so far (not found in its prefix cache), from its /metrics text."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="local_compute"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def _metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def run_vllm(script: Path, w: ChatWorkload, frame: ChatFrame, tokenizer, pool_tokens: int, max_model_len: int):
    """(TTFTs, prompt tokens computed, the serve flags) of the same sessions on vLLM-CPU."""
    from bench.load.servers import PeerServer

    flags = vllm_serve_args(pool_tokens, max_model_len)
    print(f"... vllm: starting vLLM-CPU {' '.join(flags)}", file=sys.stderr, flush=True)
    peer = PeerServer(script, free_service_port(), serve_args=flags)
    peer.start()
    try:
        warm = ChatWorkload(sessions=2, turns=1, session_rate_rps=10.0, seed=99)
        asyncio.run(drive(peer.url, VLLM_MODEL, warm, frame, tokenizer, "warm-up"))
        before = vllm_computed_tokens(_metrics(peer.url))
        ttfts = asyncio.run(drive(peer.url, VLLM_MODEL, w, frame, tokenizer, "vllm"))
        computed = vllm_computed_tokens(_metrics(peer.url)) - before
    finally:
        peer.stop()
    return ttfts, computed, flags
