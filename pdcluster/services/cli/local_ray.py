"""A Ray instance this process starts on loopback, and stops with every
process it started (gcs, raylet, dashboard and runtime-env agents).

`pdcluster up` starts one per cluster (cluster_runtime.py); the integration
tests start one for their whole run and deploy each test cluster onto it
(a LocalCluster that finds Ray running deploys onto it, and its stop()
leaves Ray up)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.services.cli.processes import reap
from pdcluster.services.cluster_env import cluster_env, replica_env

DASHBOARD_PORT = 8265


def http_url(host_port: str | None) -> str | None:
    """Ray reports its dashboard as HOST:PORT, or nothing when none runs."""
    if not host_port:
        return None
    return host_port if "://" in host_port else f"http://{host_port}"


def descendants(proc=None) -> list:
    import psutil

    try:
        return (proc or psutil.Process()).children(recursive=True)
    except psutil.Error:
        return []


@dataclass
class LocalRay:
    num_cpus: int = 8
    dashboard: bool = True
    metrics_port: int | None = None  # Ray's Prometheus endpoint for every process's metrics; None: Ray picks
    dashboard_url: str | None = None  # what Ray reports once started; None where no dashboard runs
    _roots: list = field(default_factory=list)  # processes ray.init started

    def start(self, progress=print) -> LocalRay:
        import ray

        cluster_env()
        progress(f"starting Ray ({self.num_cpus} logical CPUs, loopback only) ...")
        kwargs = {"num_cpus": self.num_cpus, "include_dashboard": self.dashboard,
                  "dashboard_host": "127.0.0.1", "dashboard_port": DASHBOARD_PORT,
                  "runtime_env": {"env_vars": replica_env()}, "log_to_driver": False}
        if self.metrics_port:
            kwargs["_metrics_export_port"] = self.metrics_port
        before = {p.pid for p in descendants()}
        ctx = ray.init(**kwargs)
        self.dashboard_url = http_url(ctx.dashboard_url)
        self._roots = [p for p in descendants() if p.pid not in before]
        return self

    def stop(self) -> None:
        import ray

        started = [*self._roots, *(c for p in self._roots for c in descendants(p))]
        if ray.is_initialized():
            ray.shutdown()
        reap(started)  # ray.shutdown() leaves its dashboard and runtime-env agents at times
        self._roots = []
