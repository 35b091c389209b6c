"""pdcluster: a disaggregated prefill/decode LLM serving cluster.

The command line: each subcommand lives in its own module that exposes
``register(subparsers)``; this file only lists them."""

from __future__ import annotations

import argparse
import sys

from pdcluster.services.cluster_env import cluster_env

# Before anything imports Ray: Ray and Serve read their settings once, at import.
cluster_env()

from bench.load import cli as bench_cli  # noqa: E402  (after cluster_env, as every command below)
from bench.plan import cli as plan_cli  # noqa: E402
from pdcluster.services.cli import drain, join, model, status, trace, up  # noqa: E402

# each registers one or more subcommands, in this order in --help
COMMANDS = (model, up, join, status, drain, trace, bench_cli, plan_cli)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
