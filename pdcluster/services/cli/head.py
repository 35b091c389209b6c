"""`pdcluster up --head`: the head node of a multi-host cluster.  Starts
`ray start --head --block` on --node-ip (pdcluster/services/cli/ray_node.py), then `up`
deploys onto it as usual; joining hosts run the printed `pdcluster join`.

Before anything starts: the cluster secret must be set (KV peers on the
network authenticate with it), and the config's topology, when it says
nothing, becomes the multi-host default (gateway on the head, each pool on
the nodes of its role, KV and Redis on each node's own address)."""

from __future__ import annotations

import argparse
import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.services.config import ClusterConfig
    from pdcluster.services.cli.ray_node import RayNode

JOIN_HINT = """\
Ray head on {address} (labels {labels}); on each other host, with the same PDCLUSTER_CLUSTER_SECRET:
  pdcluster join {address} --role prefill --node-ip <that host's address>
  pdcluster join {address} --role decode --node-ip <that host's address>"""


def with_multi_host_topology(config: ClusterConfig) -> ClusterConfig:
    """``config``, its topology the multi-host default unless it set one."""
    from pdcluster.services.config import ClusterConfig
    from pdcluster.services.topology import TopologySettings, multi_host_defaults

    if config.topology != TopologySettings():
        return config
    return ClusterConfig.model_validate({**config.model_dump(), "topology": multi_host_defaults().model_dump()})


def wait_for_port(host: str, port: int, timeout_s: float, node: RayNode | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node is not None and not node.alive():
            raise SystemExit(f"`ray start --head` exited (status {node.proc.returncode}): see its output above")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"the Ray head did not listen on {host}:{port} within {timeout_s:.0f} s")


def start_head(config: ClusterConfig, args: argparse.Namespace) -> tuple[ClusterConfig, RayNode]:
    """The config to deploy and the running head node (stop it when done)."""
    from pdcluster.services.cluster_env import cluster_env
    from pdcluster.services.cli.ray_node import RayNode, head_command, node_env, node_labels

    if not args.node_ip:
        raise SystemExit("pdcluster up --head: give --node-ip, this host's address on the network the other "
                         "hosts reach it on (e.g. --node-ip 10.0.0.1)")
    env = node_env()  # exits naming the fix without the cluster secret
    cluster_env(multi_node=True)
    config = with_multi_host_topology(config)
    node = RayNode(head_command(args.node_ip, args.ray_port, args.num_cpus, role=args.role), env).start()
    node.address = f"{args.node_ip}:{args.ray_port}"
    try:
        wait_for_port(args.node_ip, args.ray_port, 120.0, node)
    except BaseException:
        node.stop()
        raise
    print(JOIN_HINT.format(address=node.address, labels=node_labels(args.role, head=True)), flush=True)
    return config, node
