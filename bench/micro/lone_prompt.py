"""One long prompt's prefill on an idle replica's engine, against the
machine's GEMM rate (issue 34: "a lone 3k-token prompt's prefill within 1.5x
of its FLOPs divided by the fingerprint's GEMM rate").

The engine is the one a bare ``pdcluster up`` prefills with on this machine
(pdcluster/services/cli/default_layout.py): on two cores or fewer its one
colocated replica, on its own threads (all the cores); on more, the prefill
replica, computing with the threads it has on an idle host: its own plus the
idle neighbours' it borrows (pdcluster/services/pools/core_lending.py), i.e.
the host's CPUs.  The FLOPs are the model's matmuls for the prompt (every
projection for every token, causal attention's QK^T and PV, the LM head for
the last token); the rate is the better of the fingerprint's two bf16 GEMM
figures (torch's oneDNN and ours), so the bound is the stricter one."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LonePrompt:
    tokens: int
    threads: int
    seconds: float          # best of the timed runs (prefix caching off)
    flops: float
    layout: str = "disaggregated"  # the default layout whose engine ran it: "colocated" or "disaggregated"

    def ratio(self, gemm_tflops: float) -> float:
        """Measured time over the time the FLOPs take at ``gemm_tflops``."""
        return self.seconds / (self.flops / (gemm_tflops * 1e12))


def prompt_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of prefilling ``tokens`` tokens of a decoder with model config ``cfg`` (pure)."""
    h, q, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_token = 2 * (h * (q + 2 * kv) * d + q * d * h + 3 * h * cfg.intermediate_size)
    attention = 2 * 2 * q * d * tokens * (tokens + 1) // 2  # QK^T and PV over the causal triangle
    return float(cfg.num_layers * (per_token * tokens + attention) + 2 * h * cfg.vocab_size)


def measure(tokens: int = 3072, threads: int | None = None, repeats: int = 2) -> LonePrompt:
    import os

    from pdcluster.services.cli.default_layout import default_layout, usable_cores
    from pdcluster.services.config import ClusterConfig
    from pdcluster.services.engine.engine import Engine
    from pdcluster.services.sampling_params import greedy

    cluster = ClusterConfig.model_validate(default_layout(usable_cores()))
    threads = threads or len(os.sched_getaffinity(0))
    config = cluster.engine_config(cluster.colocated if cluster.mode == "colocated" else cluster.prefill)
    engine = Engine(dataclasses.replace(config, enable_prefix_caching=False,
                                        kv_cache_bytes=max(config.kv_cache_bytes, 256 * 2**20)))
    engine.set_compute_threads(threads)
    prompt = [(7919 * i) % (engine.loaded.config.vocab_size - 1000) + 500 for i in range(tokens)]
    best = float("inf")
    for run in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        engine.generate([prompt], greedy(1))
        took = time.perf_counter() - start
        if run:
            best = min(best, took)
        print(f"  lone prompt {tokens} tokens, {threads} threads, {cluster.mode} layout's engine: {took:.2f} s"
              + (" (warm-up)" if not run else ""), flush=True)
    return LonePrompt(tokens, threads, best, prompt_flops(engine.loaded.config, tokens), cluster.mode)
