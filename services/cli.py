"""`pdcluster` command line.  Each subcommand lives in its own module that
exposes ``register(subparsers)``; this file only lists them."""

from __future__ import annotations

import argparse
import importlib
import sys

from services.cluster_env import cluster_env

# Before anything imports Ray: Ray and Serve read their settings once, at import.
cluster_env()

# module path -> registers one or more subcommands
COMMAND_MODULES = [
    "services.cli_model",
    "services.cli_up",
    "services.cli_join",
    "services.cli_status",
    "services.cli_trace",
    "bench.cli_bench",
    "bench.cli_plan",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
