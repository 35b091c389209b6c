"""Builds the Serve application from one ClusterConfig: small builder
functions, each returning a bound deployment."""

from __future__ import annotations

from ray.serve import Application
from ray.serve.deployment import Deployment

from pdcluster.router.peer_fetch import DEFAULT_PULL_S_PER_BLOCK
from pdcluster.router.serve_router import request_router_config
from pdcluster.services.config import ClusterConfig, PoolConfig
from pdcluster.prefix_store.url_reference import index_url_reference


# A pool of zero replicas (the prefill pool at low load): Serve takes no
# num_replicas of 0, so its own scale-to-zero holds it there.  The gateway
# sends it nothing (pdcluster/services/pools/pool_targets.py), so it stays at zero; a
# request that reached it anyway would start one replica, not wait forever.
AT_ZERO = {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1, "upscale_delay_s": 0.0,
           "downscale_delay_s": 0.0, "downscale_to_zero_delay_s": 0.0, "metrics_interval_s": 0.5,
           "look_back_period_s": 1.0}


# How often a stopping replica asks whether its requests are done (Serve's
# default is 2 s, and it waits one period even with none in flight: every
# scale-down, redeploy and stop took 2 s more than its drain).
SHUTDOWN_POLL_S = 0.25


def _pool_options(config: ClusterConfig, pool: PoolConfig, router_pool: str | None, placed_as: str) -> dict:
    """``placed_as``: the pool's name in ``config.topology`` (which Ray nodes its replicas may use)."""
    opts: dict = {
        "ray_actor_options": {"num_cpus": pool.num_cpus, **config.topology.actor_options(placed_as)},
        "max_ongoing_requests": pool.max_ongoing_requests,
        "max_queued_requests": pool.max_queue,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        # A replica Serve stops (a scale-down, a redeploy) gets no new requests and the
        # configured drain time for the ones in flight, as `pdcluster up` gives the gateway on SIGTERM.
        "graceful_shutdown_timeout_s": config.shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_POLL_S,
    }
    if pool.autoscaling:
        opts["autoscaling_config"] = pool.autoscaling
    elif pool.num_replicas == 0:
        opts["autoscaling_config"] = AT_ZERO
    else:
        opts["num_replicas"] = pool.num_replicas
    if router_pool:
        opts["request_router_config"] = request_router_config(
            router_pool, index_url=index_url_reference(config.index_url), cluster=config.cluster_name,
            model=config.served_model_name, lookup_timeout_s=config.router.lookup_timeout_s,
            policy=config.router.prefill_policy if router_pool == "prefill" else config.router.decode_policy,
            peer_pull_s_per_block=DEFAULT_PULL_S_PER_BLOCK if config.peer_fetch.enabled else None)
    return opts


def replica_args(config: ClusterConfig) -> dict:
    """The config replicas are constructed with, minus replica counts: scaling
    a pool then changes only that deployment's options, and Serve resizes it
    in place instead of restarting every deployment with new arguments."""
    sizing = {"num_replicas", "autoscaling"}
    # the autoscaler's settings are the driver's business, not the replicas'
    args = config.model_dump(exclude={"prefill": sizing, "decode": sizing, "colocated": sizing, "autoscaling": True})
    # Serve shows deployment arguments at /api/serve/applications/: the URL's password stays out (index_url_ref.py)
    args["index_url"] = index_url_reference(config.index_url)
    return args


def _versioned(deployment: Deployment, args: dict) -> Deployment:
    """A code+args version, so redeploying with only a new replica count (a
    scale) is an in-place resize; `serve.run` would otherwise mint a new
    version and restart every replica."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return deployment.options(version=f"{deployment.name}-{digest}", _internal=True)


def build_prefill(config: ClusterConfig) -> Application:
    from pdcluster.services.pools.prefill import PrefillDeployment
    args = replica_args(config)
    options = _pool_options(config, config.prefill, "prefill", "prefill")
    return _versioned(PrefillDeployment.options(**options), args).bind(args)


def build_decode(config: ClusterConfig) -> Application:
    from pdcluster.services.pools.decode import DecodeDeployment
    args = replica_args(config)
    options = _pool_options(config, config.decode, "decode", "decode")
    return _versioned(DecodeDeployment.options(**options), args).bind(args)


def build_colocated(config: ClusterConfig) -> Application:
    from pdcluster.services.pools.colocated import ColocatedDeployment
    args = replica_args(config)
    options = _pool_options(config, config.colocated, "prefill", "colocated")
    return _versioned(ColocatedDeployment.options(**options), args).bind(args)


def build_app(config: ClusterConfig) -> Application:
    """The whole cluster: gateway ingress plus its pools."""
    from pdcluster.services.gateway.deployment import GatewayDeployment

    # The gateway only relays; the pools enforce the real limits (429).
    actor_options = {"num_cpus": 0.25, **config.topology.actor_options("gateway")}
    gateway: Deployment = _versioned(GatewayDeployment.options(ray_actor_options=actor_options,
                                                               max_ongoing_requests=4096,
                                                               graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S),
                                     replica_args(config))
    if config.mode == "colocated":
        return gateway.bind(replica_args(config), colocated=build_colocated(config))
    return gateway.bind(replica_args(config), prefill=build_prefill(config), decode=build_decode(config))


def app_builder(args: dict) -> Application:
    """`serve run pdcluster.services.app:app_builder config=deploy/local.yaml` entry (and
    KubeRay's serveConfigV2).  Without index_url, REDIS_URL from the
    environment (a Kubernetes Secret: the URL holds the password)."""
    import os

    path = args.get("config")
    config = ClusterConfig.from_yaml(path) if path else ClusterConfig.model_validate(
        {k: v for k, v in args.items() if k != "config"})
    if config.index_url is None and os.environ.get("REDIS_URL"):
        config = ClusterConfig.model_validate({**config.model_dump(), "index_url": os.environ["REDIS_URL"]})
    return build_app(config)
