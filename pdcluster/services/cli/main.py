"""pdcluster: a disaggregated prefill/decode LLM serving cluster.

The command line: each subcommand lives in its own module that exposes
``register(subparsers)``; this file only lists them, and imports the one
the command line names (``pdcluster --help`` imports none).  ``bench``
runs from bench/, which only a checkout has (pdcluster/services/cli/checkout.py)."""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from pdcluster.services.cluster_env import cluster_env

# Before anything imports Ray: Ray and Serve read their settings once, at import.
cluster_env()

# name -> (module that registers it, its line in `pdcluster --help`), in --help order
COMMANDS = {
    "model": ("pdcluster.services.cli.model", "show (and check) the model the cluster serves"),
    "up": ("pdcluster.services.cli.up", "start a local cluster (Redis, Ray, Serve); the gateway on --host:--port"),
    "join": ("pdcluster.services.cli.join", "join this host to a multi-host cluster as a prefill or decode node"),
    "status": ("pdcluster.services.cli.status", "pools, replicas, queue depths and KV usage of the running cluster"),
    "scale": ("pdcluster.services.cli.status", "change a pool's replica count while serving"),
    "drain": ("pdcluster.services.cli.drain", "stop admitting at the gateway and wait for the requests in flight"),
    "trace": ("pdcluster.services.cli.trace", "draw one request's trace (stages, durations, key attributes)"),
    "bench": ("bench.load.cli", "load-test an OpenAI-compatible endpoint against SLOs (from a checkout)"),
    "plan": ("pdcluster.services.cli.plan", "size prefill/decode pools from model, hardware, traffic and SLOs"),
}


def _command_module(name: str) -> ModuleType:
    module = COMMANDS[name][0]
    if module.startswith("bench."):
        from pdcluster.services.cli.checkout import bench_or_exit

        return bench_or_exit(module, name)
    return importlib.import_module(module)


def _named_command(argv: list[str]) -> str | None:
    """The subcommand the command line names: its first word that is not an option."""
    first = next((word for word in argv if not word.startswith("-")), None)
    return first if first in COMMANDS else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand listed; only ``command``'s module imported, and its flags registered."""
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    if command is not None:
        _command_module(command).register(sub)
    for name, (_, help_line) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_line)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_named_command(argv)).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
