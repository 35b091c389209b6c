"""The autoscaler's recent decisions, kept in Redis beside the status board
so `pdcluster status` (another process) can show them: one capped list per
cluster, newest first, one JSON entry per decision tick (both pools, with
their reasons and the figures they were taken on)."""

from __future__ import annotations

import json
import time

from pdcluster.services.autoscale.policy import Measurements, PoolDecision

KEEP = 50


def _key(cluster: str) -> str:
    return f"pdc:autoscale:{cluster}"


def entry(decisions: list[PoolDecision], m: Measurements, wall_time: float | None = None) -> dict:
    return {"time": time.time() if wall_time is None else wall_time,
            "arrival_rps": round(m.arrival_rps, 3), "prompt_tokens_mean": round(m.prompt_tokens_mean, 1),
            "output_tok_s": round(m.output_tok_s, 1),
            "pools": [{"pool": d.pool, "current": d.current, "target": d.target, "need": d.need,
                       "direction": d.direction, "reason": d.reason} for d in decisions]}


def record(client, cluster: str, item: dict) -> None:
    """``client``: a redis.Redis; LPUSH + LTRIM in one round trip."""
    pipe = client.pipeline()
    pipe.lpush(_key(cluster), json.dumps(item))
    pipe.ltrim(_key(cluster), 0, KEEP - 1)
    pipe.execute()


def read_recent(redis_url: str, cluster: str, limit: int = 6) -> list[dict]:
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=2.0)
    try:
        return [json.loads(v) for v in client.lrange(_key(cluster), 0, limit - 1)]
    finally:
        client.close()


def format_recent(entries: list[dict]) -> list[str]:
    """One line per pool per tick, oldest first; changes marked."""
    lines = []
    for e in reversed(entries):
        stamp = time.strftime("%H:%M:%S", time.localtime(e["time"]))
        for p in e["pools"]:
            arrow = {"up": "UP  ", "down": "DOWN"}.get(p["direction"], "hold")
            lines.append(f"{stamp} {p['pool']:<8} {arrow} {p['current']}->{p['target']} (need {p['need']}; "
                         f"{e['arrival_rps']:.2f} req/s, {e['output_tok_s']:.0f} tok/s): {p['reason']}")
    return lines
