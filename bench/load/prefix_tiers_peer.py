"""bench.load.prefix_tiers --peer: peer prefix fetch on a local cluster
(2 prefill replicas + 1 decode, peer_fetch on, 1 thread per replica).

Each chat session (bench/load/chat_sessions.py) runs its turns on prefill
replica A (both phases there, pinned by worker name); its last turn is the
first request of the session on replica B, which pulls what A caches of
the prompt instead of computing it.  Measured per session: the share of
B's prompt it computed (prompt - cached, from its first delta), B's time to
first token beside A's for its own first turn (whole prompt computed), and
whether B's greedy tokens equal A's for the same prompt (asked of A after).
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass, field

from bench.load.chat_sessions import ChatFrame, ChatWorkload, make_sessions, next_prompt
from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import AdmissionSettings, ClusterConfig, PeerFetchSettings, PoolConfig
from pdcluster.services.pools.status_board import read_board


@dataclass
class PeerRun:
    prompt_tokens: int = 0           # B's first requests, summed
    computed_tokens: int = 0         # ... of which B computed
    first_turn_ttft_s: list[float] = field(default_factory=list)   # A, whole prompt computed
    peer_ttft_s: list[float] = field(default_factory=list)         # B, prefix pulled from A
    same_tokens: int = 0
    sessions: int = 0
    counters: dict = field(default_factory=dict)  # B's peer counters at the end

    @property
    def computed_share(self) -> float:
        return self.computed_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")


def cluster_config() -> ClusterConfig:
    pool = PoolConfig(num_cpus=1, num_threads=1, kv_cache_mib=96, max_queue=64)
    return ClusterConfig(port=free_service_port(), prefill=pool.model_copy(update={"num_replicas": 2}), decode=pool,
                         peer_fetch=PeerFetchSettings(enabled=True), lease_ttl_s=60.0,
                         admission=AdmissionSettings(shed=False))


def _generate(prompt: list[int], target: str, max_tokens: int) -> tuple[list[int], int, float]:
    """(greedy tokens, prompt tokens found cached, seconds to the first delta) on replica ``target``."""
    from ray import serve

    from pdcluster.router.routing_header import RoutingHeader
    from pdcluster.services.cli.cluster_runtime import APP_NAME
    from pdcluster.services.sampling_params import SamplingParams
    from pdcluster.services.messages import GenerateRequest

    req = GenerateRequest(f"bench-{uuid.uuid4().hex[:10]}", prompt,
                          SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                          RoutingHeader((), len(prompt), 16, max_tokens, target_worker=target))
    t0 = time.monotonic()
    stream = serve.get_deployment_handle("prefill", APP_NAME).options(stream=True).generate_colocated.remote(req)
    tokens, cached, ttft = [], None, None
    for delta in stream:
        if ttft is None:
            ttft, cached = time.monotonic() - t0, delta.num_cached_tokens
        tokens += delta.token_ids
    return tokens, cached or 0, ttft or float("nan")


def run_peer(w: ChatWorkload, frame: ChatFrame) -> PeerRun:
    from pdcluster.services.cli.cluster_runtime import LocalCluster

    config = cluster_config()
    print("... peer fetch: starting the cluster (2 prefill + 1 decode)", file=sys.stderr, flush=True)
    cluster = LocalCluster(config, num_cpus=8, dashboard=False).start(progress=lambda m: None)
    out = PeerRun()
    try:
        time.sleep(2.0)  # every replica on the status board
        a, b = sorted(s["name"] for s in read_board(cluster.config.index_url, config.cluster_name) if s["role"] == "prefill")
        system, sessions = make_sessions(w)
        for s in sessions:
            for turn in range(w.turns - 1):  # the session's turns so far, on A
                prompt = next_prompt(system, frame, s)
                reply, cached, ttft = _generate(prompt, a, w.output_tokens)
                if turn == 0 and cached == 0:
                    out.first_turn_ttft_s.append(ttft)
                s.history, s.turn = prompt + reply, s.turn + 1
            time.sleep(0.6)  # A's KV events reach the index
            prompt = next_prompt(system, frame, s)
            on_b, cached, ttft = _generate(prompt, b, w.output_tokens)
            out.prompt_tokens += len(prompt)
            out.computed_tokens += len(prompt) - cached
            out.peer_ttft_s.append(ttft)
            out.same_tokens += on_b == _generate(prompt, a, w.output_tokens)[0]
            out.sessions += 1
            print(f"... peer fetch: session {out.sessions}/{len(sessions)}: B computed {len(prompt) - cached} of "
                  f"{len(prompt)} prompt tokens, TTFT {ttft:.3f} s", file=sys.stderr, flush=True)
        time.sleep(1.5)
        board = {s["name"]: s for s in read_board(cluster.config.index_url, config.cluster_name)}
        out.counters = {k: v for k, v in board[b]["counters"].items() if k.startswith("peer_")}
    finally:
        cluster.stop()
    return out
