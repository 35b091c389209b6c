"""The environment a local cluster runs in, set before Ray is imported or
started (Ray and Serve read these once, at import; the daemons, workers and
replicas Ray starts inherit them).  Every value is a default: a variable
already set wins.

- Loopback only: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps every Ray
  process on 127.0.0.1 (a multi-host cluster sets it to 1:
  ``cluster_env(multi_node=True)``, pdcluster/services/cli/ray_node.py), and UCX uses the
  loopback device unless the topology's internal address says otherwise
  (pdcluster/transfer/address.py, see NOTES.md).
- ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: Serve's documented throughput mode --
  user code on the replica's main event loop instead of a second thread,
  gRPC between deployments, the garbage collector frozen after start-up.
  With Serve's proxy in front (``ingress: serve_proxy``) this mode cut the
  gateway's CPU per token by half and raised 16-way streaming throughput by
  ~22% on 2 cores (issue 7 note).  Serve's own direct ingress, which it
  would also turn on, stays off: with ``ingress: gateway`` (the default) the
  gateway serves the configured port itself (pdcluster/services/gateway/http.py).
  Nor does its log buffer (1,000 records a replica, written when full or on
  an error): ``RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1`` writes a replica's
  log, ours included (pdcluster/services/replica_logs.py), as it happens, and
  a replica that is killed loses none of it; a request writes a few lines.
  The driver (``pdcluster up``, the tests, a script holding a handle) keeps
  Serve's router on its own loop, so handles still work from plain
  synchronous code; replicas get the router on their main loop
  (``REPLICA_ENV``, passed through Ray's runtime_env).
- Serve's own metrics leave a replica or a handle once a second
  (``RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000``; Serve's default is every
  100 ms).  They feed Ray's metrics agent, which Prometheus scrapes every few
  seconds, so nothing reads them finer; at 100 ms an idle replica and the
  gateway woke ten times a second each to hand them over (30 s of an idle
  `pdcluster up` on 2 cores: the two took 1.12 s of CPU, 0.89 s at 1 s).
- Serve's controller runs its control loop four times a second
  (``RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.25``; Serve's default is ten): the
  loop moves replicas through their states and starts health checks, so a
  replica's start or replacement waits at most 0.15 s longer, next to the
  seconds a replica takes to start.  Idle, the controller was the cluster's
  busiest process (30 s of an idle `pdcluster up` on 2 cores: controller
  0.88 s and Ray's GCS 0.47 s of CPU at 0.1 s; 0.51 and 0.29 s at 0.25 s;
  launch to ready 15.7-17.1 s and 14.9-18.9 s).
- Replicas at normal priority: ``RAY_worker_niceness=0``.  Ray starts its
  workers (every Serve replica) at nice 15 by default, below any ordinary
  process on the host, so a build, a test run or a load generator beside the
  cluster took the cores from prefill and decode; the serving replicas are
  the host's work, not background.  Seen on a 2-core machine: replicas at
  nice 15 lost up to 0.6 cores to nice-10 processes during a benchmark.
- Large tensors (weights, the KV pool) on 2 MiB pages: same-host KV pulls pin
  every page, and huge pages about double their bandwidth (pdcluster/transfer/pool_alloc.py).
- A replica that dies of a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT,
  SIGILL) writes every thread's Python stack to its stderr log first
  (``PYTHONFAULTHANDLER=1``; Ray's ``worker-*.err``): Ray itself reports
  only that a worker died, the same words for an OOM kill and a crash.
- Secrets (the cluster secret, API keys, a Redis URL with its password) are
  never in ``replica_env()``: Ray's runtime-env agent logs every runtime_env
  it sets up.  They reach the replicas the way the defaults above do, by
  inheritance from the driver's environment (pdcluster/services/cluster_secret.py).
"""

from __future__ import annotations

import os
import sys

DEFAULTS = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "UCX_NET_DEVICES": "lo",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.25",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "THP_MEM_ALLOC_ENABLE": "1",
    "RAY_worker_niceness": "0",
    "PYTHONFAULTHANDLER": "1",
}
DRIVER_ENV = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1"}
REPLICA_ENV = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def replica_env() -> dict[str, str]:
    """Environment variables for Ray's runtime_env: the cluster's, as set now,
    for the replicas.  Ray writes these to its logs: nothing secret here."""
    return {**{k: os.environ[k] for k in DEFAULTS}, **REPLICA_ENV}


MULTI_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}


def cluster_env(multi_node: bool = False) -> None:
    """Sets the defaults above.  If Ray was imported first, its loopback
    switch (read once, at import) is set to what the environment now says.
    ``multi_node``: this process starts, joins or drives a cluster of several
    hosts, so Ray may bind the node's address (it wins over the default)."""
    if multi_node:
        os.environ.update(MULTI_NODE_ENV)
        # Ray turns token authentication on by itself for a local cluster, never
        # when connecting to an explicit address: say it, so the driver joins
        # the token-authenticated cluster `ray start` made.
        if "RAY_AUTH_MODE" not in os.environ:
            os.environ["RAY_AUTH_MODE"] = "token"
            raylet = sys.modules.get("ray._raylet")
            if raylet is not None:  # already read: refresh it, as Ray's own _enable_token_auth does
                raylet.Config.initialize("")
    for key, value in (DEFAULTS | DRIVER_ENV).items():
        os.environ.setdefault(key, value)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] != "0"
