"""The driver of the two-host test, run inside host A's namespace (the Ray
head's): deploys onto the two-node Ray cluster, sends real requests to the
gateway on A's loopback, computes the same prompts' greedy answers with an
in-process engine (the single-host result), and prints one JSON line.

    python two_host_driver.py RAY_ADDRESS NODE_IP VETH_DEV"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from pdcluster.services.cluster_env import cluster_env  # noqa: E402

cluster_env(multi_node=True)

PROMPTS = [
    "Explain in two sentences why the sky looks blue at noon and red at sunset, for a curious ten-year-old "
    "who has just asked about it on a long car journey through the countryside.",
    "Write a short list of three practical tips for keeping a small vegetable garden healthy during a hot, "
    "dry summer with little rain and a strict limit on how much water may be used each week.",
    "What is the capital of France, and which river flows through it? Answer in one sentence.",
]
MAX_TOKENS = 16
FAILOVER_STREAMS, FAILOVER_TOKENS = 2, 24
# bf16, the default, as the failover tests on one host (tests/integration/faults/failover):
# a resumed stream recomputes its prompt through the prefill kernel and the tokens
# already sent as decode rows, so its logits equal the original steps' bit for bit
# (tests/integration/engine/test_engine_resume_bf16.py) and greedy text cannot flip.
DTYPE = "bfloat16"


def tx_bytes(dev: str) -> int:
    return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())


def ask(base: str, prompt: str) -> dict:
    import httpx

    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120.0)
    answer.raise_for_status()
    return answer.json()


def reference(prompts: list[str]) -> list[str]:
    from pdcluster.services.engine.config import EngineConfig
    from pdcluster.services.engine.engine import Engine
    from pdcluster.services.sampling_params import greedy

    engine = Engine(EngineConfig(num_kv_blocks=64, dtype=DTYPE))
    return [engine.generate([engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])],
                            greedy(MAX_TOKENS))[0].text_delta for p in prompts]


def kill_the_decode_host_replica(cluster, base: str) -> dict:
    """Two greedy streams, then the same two with host B's only decode replica
    SIGKILLed mid-stream: as on one host, they resume on its respawn and
    finish with the same text (bench/load/failover.py's round, as the fault tests use)."""
    import asyncio

    from bench.load.failover import body, kill_one_decode_replica, run_round

    requests = [body(i, FAILOVER_TOKENS) for i in range(FAILOVER_STREAMS)]
    reference = asyncio.run(run_round(base, requests))
    disturbed = asyncio.run(run_round(base, requests, kill=kill_one_decode_replica(cluster, FAILOVER_STREAMS)))
    return {"reference": [r.text for r in reference],
            "texts": [d.text for d in disturbed], "completed": [d.completed for d in disturbed],
            "errors": [d.errors for d in disturbed], "tokens": [d.completion_tokens for d in disturbed]}


def main(address: str, node_ip: str, dev: str) -> int:
    from pdcluster.prefix_store.redis_server import free_service_port
    from pdcluster.services.cli.cluster_runtime import LocalCluster
    from pdcluster.services.config import AdmissionSettings, ClusterConfig, PoolConfig
    from pdcluster.services.pools.status_board import read_board

    pool = PoolConfig(num_cpus=1, num_threads=1, kv_cache_mib=96, max_queue=8)
    # inter_token_timeout_s: the killed decode replica's respawn on host B loads the model
    # again, which takes longer than the default 30 s on a busy 2-core machine.
    config = ClusterConfig.model_validate({
        "port": free_service_port(), "prefill": pool.model_dump(), "decode": pool.model_dump(), "dtype": DTYPE,
        "transfer_backend": "nixl", "lease_ttl_s": 120.0,
        # KV must cross the veth: every prompt through the prefill pool.
        "admission": AdmissionSettings(shed=False, inter_token_timeout_s=150.0, max_local_prefill_s=0.0).model_dump(),
        "topology": {"internal_host": "node", "allow_transfer_fallback": False,
                     "gateway": {"node_selector": {"pdcluster/head": "true"}},
                     "prefill": {"node_selector": {"pdcluster/role": "prefill"}},
                     "decode": {"node_selector": {"pdcluster/role": "decode"}}}})
    cluster = LocalCluster(config, dashboard=False, address=address, node_ip=node_ip)
    out: dict = {}
    try:
        t0 = time.perf_counter()
        def progress(message: str) -> None:
            print(f"{time.perf_counter() - t0:6.1f}s {message}", file=sys.stderr, flush=True)

        cluster.start(progress=progress)
        out["ready_s"] = time.perf_counter() - t0
        base = f"http://127.0.0.1:{cluster.config.port}"
        time.sleep(1.2)  # > two status periods: the board holds the readiness probe's pull too
        out["board_before"] = read_board(cluster.config.index_url, cluster.config.cluster_name)
        sent_before = tx_bytes(dev)
        answers = [ask(base, p) for p in PROMPTS]
        out["veth_tx_bytes"] = tx_bytes(dev) - sent_before
        out["texts"] = [a["choices"][0]["message"]["content"] for a in answers]
        time.sleep(1.2)  # > two status periods: the board holds the final counters
        out["board"] = read_board(cluster.config.index_url, cluster.config.cluster_name)
        out["failover"] = kill_the_decode_host_replica(cluster, base)
    finally:
        cluster.stop()
    out["reference"] = reference(PROMPTS)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
