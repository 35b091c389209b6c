"""`pdcluster up`: a local cluster on 127.0.0.1 until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading

SNIPPET = """\
ready in {ready:.0f} s: {mode} cluster serving {model}
  OpenAI API    http://{host}:{port}/v1     (GET /v1/models, POST /v1/chat/completions, /v1/completions)
  Ray dashboard http://127.0.0.1:8265        (deployments: gateway, {pools})
try:
  curl -s http://{host}:{port}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32}}'
  python -c "import openai; c = openai.OpenAI(base_url='http://{host}:{port}/v1', api_key='-'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)"
Ctrl-C stops everything this command started (Serve, Ray, Redis)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a local cluster (Redis, Ray, Serve) on 127.0.0.1")
    p.add_argument("--config", help="cluster YAML (see deploy/local.yaml)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"])
    p.add_argument("--port", type=int)
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs Ray schedules replicas on")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.cluster_runtime import LocalCluster
    from services.config import ClusterConfig

    config = ClusterConfig.from_yaml(args.config) if args.config else ClusterConfig()
    updates = {k: v for k, v in (("mode", args.mode), ("port", args.port)) if v is not None}
    config = config.model_copy(update=updates) if updates else config
    stop = threading.Event()

    def on_signal() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

    on_signal()
    cluster = LocalCluster(config, num_cpus=args.num_cpus)
    try:
        # ray.init installs its own SIGTERM handler, which would exit without stopping anything
        cluster.start(progress=lambda m: print(m, flush=True), on_ray_started=on_signal)
        pools = "colocated" if config.mode == "colocated" else "prefill, decode"
        print(SNIPPET.format(ready=cluster.ready_s, mode=config.mode, model=config.served_model_name,
                             host=config.host, port=config.port, pools=pools), flush=True)
        stop.wait()
        print("stopping ...", flush=True)
    finally:
        cluster.stop()
    print("stopped: Serve, Ray and the embedded Redis are down", flush=True)
    return 0
