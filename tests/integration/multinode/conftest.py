"""Two Ray nodes on two "hosts": network namespaces joined by a veth pair
(bench/micro/netns.py).  Host A runs the Ray head (label pdcluster/role=prefill,
pdcluster/head=true), host B a worker node (pdcluster/role=decode), both
started by the same `ray start` commands `pdcluster up --head` and
`pdcluster join` run (pdcluster/services/cli/ray_node.py), with one cluster secret.
Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile

import pytest

from bench.micro.netns import HostPair, two_hosts, unavailable_reason

RAY_PORT = 6379  # inside host A's namespace: nothing else listens there


class TwoNodeCluster:
    def __init__(self, pair: HostPair, env: dict[str, str], head, worker) -> None:
        self.pair, self.env, self.head, self.worker = pair, env, head, worker
        self.address = f"{pair.ip_a}:{RAY_PORT}"


def _tail(path: str, limit: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return "(no log)"


def _wait_for_log(node, text: str, timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while text not in _tail(node.log_path, 1 << 20):
        if not node.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"`{' '.join(node.command)}` did not log {text!r}:\n{_tail(node.log_path)}")
        time.sleep(0.5)


def _wait_for_nodes(pair: HostPair, env: dict[str, str], head, worker, timeout_s: float = 90.0) -> None:
    """Until the head answers and both nodes are registered (`ray status` from A)."""
    import subprocess
    import time

    from pdcluster.services.cli.ray_node import ray_binary

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        for node in (head, worker):
            if not node.alive():
                raise RuntimeError(f"`ray start` exited early (status {node.proc.returncode}): "
                                   f"{' '.join(node.command)}\n{_tail(node.log_path)}")
        status = subprocess.run([*pair.exec_prefix(pair.ns_a), ray_binary(), "status",
                                 f"--address={pair.ip_a}:{RAY_PORT}"], env=env, capture_output=True, text=True)
        last = status.stdout + status.stderr
        if status.returncode == 0 and last.count("node_") >= 2:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the two Ray nodes did not come up within {timeout_s:.0f} s:\n{last[-2000:]}")


@pytest.fixture(scope="module")
def two_node_cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"two-host test needs network namespaces: {reason}")
    from pdcluster.services.cli.ray_node import RayNode, head_command, join_command, node_env

    base = {**os.environ, "PDCLUSTER_CLUSTER_SECRET": secrets.token_hex(32),
            "RAY_AUTH_TOKEN": secrets.token_hex(32),  # this cluster's own Ray token, on both nodes and the driver
            "UCX_TLS": "tcp"}  # one kernel under both "hosts": without this UCX would use shared memory
    env = node_env(base)
    temp_root = tempfile.mkdtemp(prefix="pdc2h-")  # short: Ray's socket paths must fit 107 bytes
    with two_hosts() as pair:
        head = RayNode(head_command(pair.ip_a, RAY_PORT, num_cpus=4, role="prefill",
                                    temp_dir=f"{temp_root}/a"), env, pair.exec_prefix(pair.ns_a))
        worker = RayNode(join_command(f"{pair.ip_a}:{RAY_PORT}", "decode", node_ip=pair.ip_b, num_cpus=2,
                                      temp_dir=f"{temp_root}/b"), env, pair.exec_prefix(pair.ns_b))
        try:
            head.start(f"{temp_root}/head.log")
            _wait_for_log(head, "Ray runtime started", 90.0)
            worker.start(f"{temp_root}/worker.log")
            # Its raylet is up (and registering) once it says so: only then ask `ray status`
            # (a Python process of a second or two each) whether both nodes are in.
            _wait_for_log(worker, "Ray runtime started", 90.0)
            _wait_for_nodes(pair, env, head, worker)
            yield TwoNodeCluster(pair, env, head, worker)
        finally:
            worker.stop()
            head.stop()
            shutil.rmtree(temp_root, ignore_errors=True)
