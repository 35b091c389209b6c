"""`pdcluster join ADDRESS --role prefill|decode`: this host becomes a node
of a multi-host cluster whose head runs `pdcluster up --head`.  A thin
wrapper over `ray start --block` (pdcluster/services/cli/ray_node.py): the node carries the
label pdcluster/role=ROLE, which the topology's node_selector matches, and
runs until Ctrl-C.  The cluster secret must be set, the same as the head's."""

from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("join", help="join this host to a multi-host cluster as a prefill or decode node")
    p.add_argument("address", help="the head's Ray address, HOST:PORT (what `pdcluster up --head` printed)")
    p.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"],
                   help="the pool this node hosts (node label pdcluster/role=ROLE)")
    p.add_argument("--node-ip", help="this host's address on the internal network (default: Ray picks one)")
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs Ray schedules replicas on")
    p.add_argument("--dry-run", action="store_true", help="print the `ray start` command instead of running it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdcluster.services.cli.ray_node import join_command, node_env

    if ":" not in args.address:
        raise SystemExit(f"pdcluster join: {args.address!r} is not HOST:PORT (e.g. 10.0.0.1:6379)")
    command = join_command(args.address, args.role, node_ip=args.node_ip, num_cpus=args.num_cpus)
    env = node_env()  # exits naming the fix without the cluster secret
    if args.dry_run:
        print(" ".join(command))
        return 0
    print(f"joining {args.address} as a {args.role} node (Ctrl-C leaves the cluster) ...", flush=True)
    os.execvpe(command[0], command, env)  # `ray start --block` owns this process from here
    return 0  # unreachable
