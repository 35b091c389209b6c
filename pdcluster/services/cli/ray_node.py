"""One node of a multi-host Ray cluster, started with Ray's own `ray start`
(pdcluster adds labels and the environment, nothing else).

    host A: pdcluster up --head --node-ip 10.0.0.1      ray start --head --block
              labels pdcluster/role=head,pdcluster/head=true
    host B: pdcluster join 10.0.0.1:6379 --role decode   ray start --address ... --block
              labels pdcluster/role=decode

Replicas inherit the raylet's environment: the cluster secret
(PDCLUSTER_CLUSTER_SECRET, the same on every node) reaches them that way,
never through Ray's runtime_env.  Ray's own token authentication stays on
(RAY_AUTH_MODE=token): every host needs the head's token, the file
~/.ray/auth_token copied over or RAY_AUTH_TOKEN set.  ``--block`` keeps `ray start` in the
foreground: stopping that one process stops the node (RayNode.stop)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.services.cluster_env import MULTI_NODE_ENV
from pdcluster.services.cluster_secret import CLUSTER_SECRET_ENV, cluster_secret
from pdcluster.services.cli.processes import reap
from pdcluster.services.topology import HEAD_LABEL, ROLE_LABEL

ROLES = ("prefill", "decode", "colocated", "head")
DEFAULT_RAY_PORT = 6379


def ray_binary() -> str:
    """The `ray` next to this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.exists() else "ray"


def node_labels(role: str, head: bool) -> str:
    """`ray start --labels` value: the pool role, and whether this is the head."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: choose one of {', '.join(ROLES)}")
    labels = {ROLE_LABEL: role, **({HEAD_LABEL: "true"} if head else {})}
    return ",".join(f"{k}={v}" for k, v in labels.items())


def head_command(node_ip: str, port: int = DEFAULT_RAY_PORT, num_cpus: int = 8, role: str = "head",
                 temp_dir: str | None = None) -> list[str]:
    cmd = [ray_binary(), "start", "--head", "--block", "--disable-usage-stats", f"--node-ip-address={node_ip}",
           f"--port={port}", f"--num-cpus={num_cpus}", f"--labels={node_labels(role, head=True)}",
           "--include-dashboard=false"]
    return cmd + ([f"--temp-dir={temp_dir}"] if temp_dir else [])


def join_command(address: str, role: str, node_ip: str | None = None, num_cpus: int = 8,
                 temp_dir: str | None = None) -> list[str]:
    cmd = [ray_binary(), "start", "--block", "--disable-usage-stats", f"--address={address}",
           f"--num-cpus={num_cpus}", f"--labels={node_labels(role, head=False)}"]
    cmd += [f"--node-ip-address={node_ip}"] if node_ip else []
    return cmd + ([f"--temp-dir={temp_dir}"] if temp_dir else [])


def node_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a node of a multi-host cluster runs in: Ray may leave
    loopback, and the cluster secret must be set (the same on every node).
    Raises SystemExit naming the fix when it is not."""
    env = {**(os.environ if base is None else base), **MULTI_NODE_ENV}
    # Ray's token authentication, stated: a joining `ray start` does not turn it
    # on by itself.  Every host needs the head's token (~/.ray/auth_token, or RAY_AUTH_TOKEN).
    env.setdefault("RAY_AUTH_MODE", "token")
    env.pop("UCX_NET_DEVICES", None)  # each replica picks the device of its internal address
    secret = cluster_secret(env)  # raises ValueError on a malformed one
    if secret is None:
        raise SystemExit(f"a cluster of several hosts needs {CLUSTER_SECRET_ENV}, the same on every node (KV peers "
                         "authenticate with it): `export PDCLUSTER_CLUSTER_SECRET=$(python -c 'import secrets; "
                         "print(secrets.token_hex(32))')` on the head, and the same value on every joining node")
    return env


@dataclass
class RayNode:
    """A `ray start --block` process (``prefix``: e.g. ``ip netns exec NS``)."""
    command: list[str]
    env: dict[str, str]
    prefix: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    address: str | None = None  # a head's HOST:PORT
    log_path: str | None = None

    def start(self, log_path: str | None = None) -> "RayNode":
        self.log_path = log_path
        out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen([*self.prefix, *self.command], env=self.env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to `ray start --block` (it stops the node's processes), then
        whatever of its own process group is left is killed."""
        if self.proc is None:
            return
        tree = _descendants(self.proc.pid)  # before they are orphaned and re-parented
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        reap([*tree, *_group(self.proc.pid)], grace_s=0)
        self.proc.wait(5)


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _group(pgid: int) -> list:
    """The session `start_new_session` made for one node: only our processes."""
    import psutil

    return [p for p in psutil.process_iter() if _pgid(p.pid) == pgid]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def node_lines(nodes: list[dict]) -> list[str]:
    """`pdcluster status`'s node table from ``ray.nodes()``: address, state,
    role and head labels, CPUs."""
    lines = [f"{'node':<14} {'address':<16} {'state':<6} {'role':<10} {'head':<5} {'CPUs':>5}"]
    for n in sorted(nodes, key=lambda n: (not n.get("Alive"), n.get("NodeManagerAddress", ""))):
        labels = n.get("Labels") or {}
        lines.append(f"{n.get('NodeID', '')[:12]:<14} {n.get('NodeManagerAddress', ''):<16} "
                     f"{'alive' if n.get('Alive') else 'DEAD':<6} {labels.get(ROLE_LABEL, '-'):<10} "
                     f"{'yes' if labels.get(HEAD_LABEL) == 'true' else '':<5} "
                     f"{(n.get('Resources') or {}).get('CPU', 0):>5g}")
    return lines


def print_nodes(address: str | None) -> None:
    """The Ray nodes of a multi-host cluster (one host: says so, connects to nothing)."""
    if not address:
        print("nodes: this host only (loopback); `pdcluster up --head` starts a multi-host cluster")
        return
    import ray

    from pdcluster.services.cluster_env import cluster_env

    cluster_env(multi_node=True)
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        print("\n".join(node_lines(ray.nodes())))
    finally:
        ray.shutdown()
