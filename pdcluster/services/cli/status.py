"""`pdcluster status` and `pdcluster scale POOL N` against a running `pdcluster up`.

The state file holds the Redis URL with its password: these commands print
it only through ``redact_url``, and `scale` rewrites the file 0600."""

from __future__ import annotations

import argparse
import json
import time

from pdcluster.prefix_store.redis_url import redact_url
from pdcluster.services.cli.cluster_runtime import STATE_FILE, write_state
from pdcluster.services.cli.tables import plain_table, table_lines


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="pools, replicas, queue depths and KV usage of the running cluster")
    p.add_argument("--json", action="store_true", help="print raw JSON")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="S",
                   help="redraw every S seconds (default 2) until Ctrl-C")
    p.set_defaults(func=run_status)
    s = sub.add_parser("scale", help="change a pool's replica count while serving")
    s.add_argument("pool", choices=["prefill", "decode", "colocated"])
    s.add_argument("replicas", type=int)
    s.set_defaults(func=run_scale)


def _state() -> dict:
    if not STATE_FILE.exists():
        raise SystemExit(f"no running cluster found ({STATE_FILE} is missing): start one with `pdcluster up`")
    return json.loads(STATE_FILE.read_text())


def format_board(board: list[dict]) -> list[str]:
    """One line per replica: role, name, engine state, running/waiting, KV used/total and dtype, leased
    blocks, blocks held in quarantine (a transfer into them not confirmed stopped), hits,
    speculative decoding's accepted/drafted tokens ('-' where it is off), blocks in the host/disk
    tiers and the share of admissions they served ('-' without tiers), prefix blocks pulled from
    and lent to peers with the pulls that fell back to recompute ('-' when none was tried or
    lent), and the KV blocks each tenant holds (in use or cached; the three largest)."""
    table = plain_table("pool", "replica", "engine", ">run", ">wait", ">kv used/total", ">kv", ">leased",
                        ">held", ">prompt hit/computed", ">tiers host/disk:hit", ">peer pull/lent:fail",
                        ">spec acc/draft", "tenants kv")
    for s in board:
        used = s["kv_blocks_total"] - s["kv_blocks_free"]
        engine = "alive" if s.get("engine_alive", True) else "DEAD"
        table.add_row(s["role"], s["name"][-34:], engine, str(s["running"]), str(s["waiting"]),
                      f"{used}/{s['kv_blocks_total']}", s.get("kv_dtype", "?"), str(s["leased_blocks"]),
                      str(s.get("quarantined_blocks", 0)), f"{s['prompt_tokens_cached']}/{s['prompt_tokens_computed']}",
                      _tiers(s), _peer(s), _spec(s), _tenants(s))
    return table_lines(table)


def _tenants(s: dict) -> str:
    charged = s.get("tenant_kv_blocks")
    if not isinstance(charged, dict) or not charged:
        return "-"
    ranked = sorted(((str(t), n) for t, n in charged.items() if isinstance(n, int)), key=lambda x: (-x[1], x[0]))
    return " ".join(f"{t[:16]}:{n}" for t, n in ranked[:3]) + (" ..." if len(ranked) > 3 else "")


def _tiers(s: dict) -> str:
    t = s.get("kv_tiers")
    if not t:
        return "-"
    hit = "-" if t["hit_rate"] is None else f"{t['hit_rate']:.0%}"
    return f"{t['host']['blocks']}/{t['disk']['blocks']}:{hit}"


def _peer(s: dict) -> str:
    c = s.get("counters") or {}
    tried, lent = c.get("peer_fetches") or 0, c.get("peer_blocks_lent") or 0
    if not tried and not lent:
        return "-"
    return f"{c.get('peer_blocks_pulled') or 0}/{lent}:{c.get('peer_fetch_failures') or 0}"


def _spec(s: dict) -> str:
    drafted = s.get("spec_proposed_tokens") or 0
    return f"{s.get('spec_accepted_tokens') or 0}/{drafted}" if drafted else "-"


def run_status(args: argparse.Namespace, sleep=time.sleep) -> int:
    """Once, or with ``--watch S`` redrawn every S seconds until Ctrl-C."""
    watch = getattr(args, "watch", None)  # callers that build their own Namespace may leave it out
    if watch is None:
        return status_once(args)
    if watch < 0.5:
        raise SystemExit(f"pdcluster status: --watch {watch:g} is too often; the board refreshes every "
                         "0.5 s: use 0.5 or more")
    try:
        while True:
            print("\033[H\033[2J", end="")   # home + clear: a redraw, not a scroll
            status_once(args)
            sleep(watch)
    except KeyboardInterrupt:
        return 0


def status_once(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from pdcluster.services.pools.status_board import read_board

    state = _state()
    try:
        board = read_board(state["redis_url"], state.get("cluster", "local"))
    except (RedisError, OSError) as exc:  # its message names host and port, never the password
        raise SystemExit(f"cannot read the status board at {redact_url(state['redis_url'])} "
                         f"({type(exc).__name__}: {exc}): is `pdcluster up` (pid {state['pid']}) still running?")
    if args.json:
        print(json.dumps(board, indent=2))
        return 0
    print(f"cluster: {state['mode']} on 127.0.0.1:{state['port']} (pid {state['pid']}), "
          f"index {redact_url(state['redis_url'])}")
    print("\n".join(format_board(board)) if board else "no replica has reported yet")
    for line in seed_warnings(state, board):
        print(line)
    from pdcluster.services.cli.ray_node import print_nodes
    print_nodes(state.get("ray_address"))
    print_autoscale(state)
    print_failovers(state)
    return 0


def seed_warnings(state: dict, board: list[dict]) -> list[str]:
    """A warning per replica whose block-hash seed is not the one the cluster's
    config gives (pdcluster/services/model_meta.py): the gateway reports unhealthy meanwhile."""
    from pdcluster.services.config import ClusterConfig
    from pdcluster.services.default_model import resolve_model_path
    from pdcluster.services.model_meta import model_hash_seed, seed_mismatches

    try:
        cfg = ClusterConfig.model_validate(state["config"])
        seed = model_hash_seed(resolve_model_path(cfg.model), cfg.dtype, cfg.kv_cache_dtype, cfg.block_size, cfg.weight_dtype)
    except (KeyError, ValueError, OSError):  # an older state file, or the model moved: nothing to compare
        return []
    return [f"warning: {line}" for line in seed_mismatches(seed, board)]


def print_failovers(state: dict) -> None:
    """Streams resumed on another replica since the cluster started, by reason
    and by path (recompute on the new replica, or the prefill pool), and those
    that gave up (pdcluster/services/gateway/failover_log.py)."""
    from redis.exceptions import RedisError

    from pdcluster.services.gateway.failover_log import read_tally, summary

    try:
        tally = read_tally(state["redis_url"], state.get("cluster", "local"))
    except (RedisError, OSError):
        return  # the board read just succeeded: a failure here is transient
    print(summary(tally))


def print_autoscale(state: dict) -> None:
    """The autoscaler's last decisions, when one runs (pdcluster/services/autoscale/controller.py)."""
    from redis.exceptions import RedisError

    from pdcluster.services.autoscale.log import format_recent, read_recent

    try:
        recent = read_recent(state["redis_url"], state.get("cluster", "local"))
    except (RedisError, OSError):
        return  # the board read just succeeded: a failure here is transient, and the board is what matters
    if recent:
        print("autoscaler, last decisions (oldest first):")
        print("\n".join(f"  {line}" for line in format_recent(recent)))


def run_scale(args: argparse.Namespace) -> int:
    import ray
    from pydantic import ValidationError

    from pdcluster.services.cluster_env import cluster_env
    from pdcluster.services.cli.cluster_runtime import redeploy
    from pdcluster.services.config import ClusterConfig

    if args.replicas < 0:
        raise SystemExit("replicas must be >= 0")
    state = _state()
    old = ClusterConfig.model_validate(state["config"])
    pool = getattr(old, args.pool).model_copy(update={"num_replicas": args.replicas, "autoscaling": None})
    try:
        config = ClusterConfig.model_validate({**old.model_dump(), args.pool: pool.model_dump()})
    except ValidationError as exc:
        raise SystemExit("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
    cluster_env()
    ray.init(address="auto", log_to_driver=False)
    redeploy(old, config)
    state["config"] = config.model_dump()
    write_state(state)
    print(f"{args.pool}: {args.replicas} replicas requested; in-flight requests finish on the old ones")
    return 0
