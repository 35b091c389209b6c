"""`pdcluster up`: a local cluster until SIGINT/SIGTERM.  The gateway listens
on --host (127.0.0.1 by default); a non-loopback host needs an API key
(pdcluster.services.config.exposure_problem), checked before anything starts."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.services.config import ClusterConfig

SNIPPET = """\
ready in {ready:.0f} s: {mode} cluster serving {model}
  OpenAI API    http://{host}:{port}/v1     (GET /v1/models, POST /v1/chat/completions, /v1/completions)
  Monitoring    http://{host}:{port}/metrics (vLLM's names too)  probes: /live, /ready  (docs/operating.md)
{dashboard}{auth}try:
  curl -s http://{host}:{port}/v1/chat/completions -H 'content-type: application/json'{curl_auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32}}'
  python -c "import os, openai; c = openai.OpenAI(base_url='http://{host}:{port}/v1', api_key={py_key}); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)"
Ctrl-C stops everything this command started (Serve, Ray, Redis)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a local cluster (Redis, Ray, Serve); the gateway on --host:--port")
    p.add_argument("--config", help="cluster config YAML: ClusterConfig's keys at the top level "
                                     "(e.g. deploy/race.yaml; deploy/local.yaml is for `serve run`)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"],
                   help="default: the layout measured best for this machine (one colocated replica on 2 cores or "
                        "fewer, else 1 prefill + 1 decode replica; services/cli/default_layout.py), also under a "
                        "--config that names no layout (none of mode, prefill, decode, colocated)")
    p.add_argument("--host", help="address the gateway listens on (default 127.0.0.1); any non-loopback "
                                  "address needs an API key (PDCLUSTER_API_KEY, api_keys, api_key_file)")
    p.add_argument("--port", type=int)
    p.add_argument("--weight-dtype", choices=["auto", "int8"],
                   help="decoder projections and LM head in int8 (groups of 32 with fp16 scale and offset, bf16 "
                        "activations; a GGUF's Q4_1/Q8_0 blocks exactly) or as "
                        "the model dtype (auto, the default); overrides the config's weight_dtype")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a non-loopback --host without any API key (anyone who reaches it may use it)")
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs Ray schedules replicas on")
    p.add_argument("--head", action="store_true",
                   help="start the head of a multi-host cluster (`ray start --head`); other hosts run "
                        "`pdcluster join`.  Needs PDCLUSTER_CLUSTER_SECRET, the same on every node")
    p.add_argument("--node-ip", help="with --head: this host's address on the internal network")
    p.add_argument("--ray-port", type=int, default=6379, help="with --head: the Ray head's port")
    p.add_argument("--role", default="head", choices=["head", "prefill", "decode", "colocated"],
                   help="with --head: a pool the head also hosts (node label pdcluster/role)")
    p.set_defaults(func=run)


def load_config(args: argparse.Namespace) -> ClusterConfig:
    """The config the flags and --config say, validated (keys gathered, the
    exposure refused) before anything starts.  Raises SystemExit with one
    message naming the fix."""
    from pydantic import ValidationError

    from pdcluster.services.cli.default_layout import default_layout, usable_cores
    from pdcluster.services.config import ClusterConfig

    overrides = {k: v for k, v in (("mode", args.mode), ("host", args.host), ("port", args.port),
                                   ("weight_dtype", getattr(args, "weight_dtype", None))) if v is not None}
    if args.insecure_no_auth:
        overrides["insecure_no_auth"] = True
    try:
        # the layout measured best here, unless the flags or the file name one
        layout = {} if "mode" in overrides or getattr(args, "head", False) else default_layout(usable_cores())
        if args.config:
            return ClusterConfig.from_yaml(args.config, overrides, default_layout=layout)
        if layout:
            overrides = {**layout, **overrides}
        return ClusterConfig.model_validate(overrides)
    except ValidationError as exc:  # the errors' inputs are hidden: they may hold an API key
        problems = [_problem(e) for e in exc.errors(include_url=False, include_input=False)]
        raise SystemExit("pdcluster up: " + "\n  ".join(problems)) from None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"pdcluster up: {exc}") from None


def _problem(error: dict) -> str:
    where = ".".join(map(str, error["loc"]))
    return (f"{where}: " if where else "") + error["msg"].removeprefix("Value error, ")


def dashboard_line(url: str | None, pools: str, env: Mapping[str, str] | None = None,
                   home: Path | None = None) -> str:
    """The snippet's dashboard lines: the URL Ray reported once started and,
    with Ray's token authentication on, how to get the token it asks for;
    or where to look instead (`up --head` runs `ray start --include-dashboard=false`).
    ``env``/``home``: where Ray reads its auth settings (os.environ, ~)."""
    if not url:
        return "  Ray dashboard none on this node: `pdcluster status` shows nodes, pools and replicas\n"
    return f"  Ray dashboard {url:<28} (deployments: gateway, {pools})\n" + dashboard_token_line(
        os.environ if env is None else env, Path.home() if home is None else home)


def dashboard_token_line(env: Mapping[str, str], home: Path) -> str:
    """Ray (RAY_AUTH_MODE=token, its default for a local cluster) asks the
    dashboard's visitors for its token: say where it is, never the token."""
    if env.get("RAY_AUTH_MODE", "").lower() != "token":
        return ""
    if env.get("RAY_AUTH_TOKEN"):
        where = "the RAY_AUTH_TOKEN environment variable of this shell"
    else:
        where = env.get("RAY_AUTH_TOKEN_PATH") or str(home / ".ray" / "auth_token")
    return f"  Ray token     the dashboard asks for it: `ray get-auth-token` prints it (from {where})\n"


def drain_summary(result: dict) -> str:
    """One line from the gateway's drain answer (LocalCluster.drain)."""
    if "error" in result:
        return f"could not drain ({result['error']}); stopping anyway"
    if result.get("drained"):
        return f"every request finished in {result.get('waited_s', 0):.1f} s"
    return f"{result.get('in_flight', '?')} request(s) still in flight at the timeout; stopping them"


def _auth_lines(config: ClusterConfig) -> dict:
    """The snippet's API-key parts; never the key itself."""
    from pdcluster.services.config import is_loopback

    if config.api_key_digests:
        return {"auth": f"  API keys      {len(config.api_key_digests)} accepted: "
                        "every /v1 request needs `Authorization: Bearer <key>`\n",
                "curl_auth": ' -H "authorization: Bearer $PDCLUSTER_API_KEY"',
                "py_key": "os.environ['PDCLUSTER_API_KEY']"}
    warning = "" if is_loopback(config.host) else \
        f"  WARNING       no API key on {config.host} (--insecure-no-auth): anyone who reaches it may use it\n"
    return {"auth": warning, "curl_auth": "", "py_key": "'-'"}


def run(args: argparse.Namespace) -> int:
    config = load_config(args)
    from pdcluster.services.cli.cluster_runtime import LocalCluster

    head = None
    if args.head:
        from pdcluster.services.cli.head import start_head

        config, head = start_head(config, args)
    stop = threading.Event()

    def on_signal() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

    on_signal()
    cluster = LocalCluster(config, num_cpus=args.num_cpus, address=head.address if head else None,
                           node_ip=args.node_ip)
    autoscaler = None
    try:
        # ray.init installs its own SIGTERM handler, which would exit without stopping anything
        cluster.start(progress=lambda m: print(m, flush=True), on_ray_started=on_signal)
        pools = "colocated" if config.mode == "colocated" else "prefill, decode"
        print(SNIPPET.format(ready=cluster.ready_s, mode=config.mode, model=config.served_model_name,
                             host=config.host, port=config.port,
                             dashboard=dashboard_line(cluster.dashboard_url, pools), **_auth_lines(config)), flush=True)
        if config.autoscaling.enabled:
            from pdcluster.services.autoscale.controller import Autoscaler
            autoscaler = Autoscaler(cluster).start()
            print("autoscaler on: decisions in `pdcluster status`", flush=True)
        stop.wait()
        if config.shutdown_timeout_s > 0:
            print(f"draining: new requests get 503; streams in flight get {config.shutdown_timeout_s:g} s "
                  "(shutdown_timeout_s) ...", flush=True)
            print(f"drained: {drain_summary(cluster.drain(config.shutdown_timeout_s))}", flush=True)
        print("stopping ...", flush=True)
    finally:
        if autoscaler is not None:
            autoscaler.stop()
        try:
            cluster.stop()
        finally:
            if head is not None:
                head.stop()
    print("stopped: Serve, Ray and the embedded Redis are down", flush=True)
    return 0
