"""`pdcluster drain [--timeout S]`: the gateway of the running cluster stops
admitting (new requests 503 + Retry-After, /ready 503) and this command
waits until its requests in flight have finished, at most S seconds.  Exit
0 when they did, 1 otherwise.  Kubernetes runs it as the head pod's preStop
hook (deploy/kuberay/rayservice.yaml); `pdcluster up` does the same itself
on SIGTERM or Ctrl-C (shutdown_timeout_s)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drain", help="stop admitting at the gateway and wait for the requests in flight")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait at most (default 30)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import ray

    from pdcluster.services.cli.cluster_runtime import drain_gateway
    from pdcluster.services.cli.up import drain_summary
    from pdcluster.services.cluster_env import cluster_env

    if args.timeout < 0:
        raise SystemExit("pdcluster drain: --timeout must be >= 0 seconds")
    cluster_env()
    try:
        ray.init(address="auto", log_to_driver=False)
    except ConnectionError as exc:
        raise SystemExit(f"pdcluster drain: no running Ray cluster to drain ({exc}); "
                         "start one with `pdcluster up`") from None
    result = drain_gateway(args.timeout)
    print(f"drained: {drain_summary(result)}", flush=True)
    return 0 if result.get("drained") else 1
