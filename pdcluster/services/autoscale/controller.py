"""The autoscaling controller: a thread in the process that started the
cluster (`pdcluster up`, the benches) that, every ``interval_s``,

    scrape   GET /metrics on the gateway (pdcluster/services/autoscale/signals.py)
    measure  differences over the last ``window_s`` of scrapes
    decide   pdcluster/services/autoscale_policy.decide: pure, typed, with reasons
    apply    a changed pool count through LocalCluster.apply -- the same
             redeploy `pdcluster scale` does (Serve resizes the pool in
             place; the call returns once the new replicas serve); the
             cool-downs then count from that moment, and the window restarts
    record   one log line per change, every tick in Redis for `pdcluster status`

Why a controller and not a Ray Serve autoscaling policy (Ray 2.60 takes a
custom ``policy`` function per deployment): the rule needs the gateway's
admission queue and client-side latencies, which live in another
deployment, and a policy function runs inside the Serve controller's loop,
where a blocking HTTP or Redis read would stall every deployment's
reconciliation.  Here the I/O happens outside the decision, and the
decision is the same pure function either way.

One controller per cluster; `pdcluster scale` while it runs is overridden
at its next change."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from pdcluster.services.autoscale.policy import (
    POOLS, Measurements, PoolDecision, PoolState, ScalerState, ScalingRules, decide,
)
from pdcluster.services.autoscale.signals import Scrape, measurements, parse_scrape
from pdcluster.services.config import AutoscalingSettings, ClusterConfig

log = logging.getLogger("pdcluster.autoscale")


def scaling_rules(settings: AutoscalingSettings, max_num_seqs: int) -> ScalingRules:
    s = settings
    return ScalingRules(
        ttft_slo_s=s.ttft_slo_s, tpot_slo_s=s.tpot_slo_s, headroom=s.headroom, max_utilization=s.max_utilization,
        max_num_seqs=max_num_seqs, local_prefill_max_share=s.local_prefill_max_share, down_margin=s.down_margin, up_cooldown_s=s.up_cooldown_s,
        down_cooldown_s=s.down_cooldown_s, down_stable_s=s.down_stable_s, min_latency_samples=s.min_latency_samples,
        calibration_samples=s.calibration_samples,
        bounds=((s.prefill.min_replicas, s.prefill.max_replicas), (s.decode.min_replicas, s.decode.max_replicas)))


def speed_models(settings: AutoscalingSettings):
    """The shared PrefillModel and StepModel from the config's figures."""
    return settings.speed.models()


def http_metrics_fetcher(config: ClusterConfig) -> Callable[[], str]:
    import httpx

    url = f"http://{config.host}:{config.port}/metrics"
    key = config.client_api_key()
    headers = {"authorization": f"Bearer {key}"} if key else {}

    def fetch() -> str:
        response = httpx.get(url, headers=headers, timeout=2.0)
        response.raise_for_status()
        return response.text

    return fetch


class Autoscaler:
    """``cluster``: a started cluster: ``config`` and ``apply(config)`` (the CLI's LocalCluster), so the
    autoscaler never imports the CLI that starts it."""

    def __init__(self, cluster, settings: AutoscalingSettings | None = None, *,
                 fetch: Callable[[], str] | None = None, clock: Callable[[], float] = time.monotonic):
        config: ClusterConfig = cluster.config
        if config.mode != "disaggregated":
            raise ValueError(f"the autoscaler sizes the prefill and decode pools apart; mode {config.mode} has "
                             "neither: run disaggregated, or give the colocated pool Ray Serve's "
                             "autoscaling_config (colocated.autoscaling)")
        self.cluster, self.settings = cluster, settings or config.autoscaling
        self.rules = scaling_rules(self.settings, config.scheduler.max_num_seqs)
        self.prefill_speed, self.step_speed = speed_models(self.settings)
        self.state = ScalerState(PoolState(config.prefill.num_replicas), PoolState(config.decode.num_replicas))
        self.fetch = fetch or http_metrics_fetcher(config)
        self.clock = clock
        self.window: deque[Scrape] = deque()
        self.history: list[tuple[float, list[PoolDecision]]] = []  # (clock, decisions) of every tick
        self._redis = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- one tick -------------------------------------------------------------

    def observe(self) -> Measurements | None:
        now = self.clock()
        self.window.append(parse_scrape(self.fetch(), now))
        while len(self.window) > 2 and now - self.window[1].t_s >= self.settings.window_s:
            self.window.popleft()
        return measurements(list(self.window), now)

    def tick(self) -> list[PoolDecision] | None:
        m = self.observe()
        if m is None:
            return None
        decisions, self.state = decide(m, self.state, self.prefill_speed, self.step_speed, self.rules)
        self.history.append((m.now_s, decisions))
        changed = [d for d in decisions if d.direction != "hold"]
        for d in changed:
            log.info("autoscale %s %s %d -> %d (need %d): %s", d.pool, d.direction, d.current, d.target, d.need,
                     d.reason)
        self._record(decisions, m)
        if changed:
            self.apply({d.pool: d.target for d in changed})
            live = self.clock()  # the redeploy returns once the new replicas serve: minutes on a busy machine
            for d in changed:
                self.state = self.state.changed_at(d.pool, live)
            self.window.clear()  # figures from before the change describe another deployment
        return decisions

    def apply(self, targets: dict[str, int]) -> None:
        config = self.cluster.config
        updates = {pool: getattr(config, pool).model_copy(update={"num_replicas": n, "autoscaling": None})
                   for pool, n in targets.items()}
        self.cluster.apply(config.model_copy(update=updates))  # which keeps `pdcluster status`'s state file current

    def _record(self, decisions: list[PoolDecision], m: Measurements) -> None:
        from pdcluster.services.autoscale import log as autoscale_log
        try:
            if self._redis is None:
                import redis
                self._redis = redis.Redis.from_url(self.cluster.config.index_url, socket_timeout=1.0)
            autoscale_log.record(self._redis, self.cluster.config.cluster_name, autoscale_log.entry(decisions, m))
        except Exception as exc:  # noqa: BLE001 - the record is for operators; scaling goes on without it
            log.debug("decision not recorded: %s", exc)

    # --- the thread -------------------------------------------------------------

    def start(self) -> Autoscaler:
        self._thread = threading.Thread(target=self._run, name="pdcluster-autoscaler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - a failed scrape or redeploy: try again next tick
                log.warning("autoscale tick failed: %s: %s", type(exc).__name__, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
        if self._redis is not None:
            self._redis.close()
            self._redis = None

    def replicas(self) -> dict[str, int]:
        return {pool: self.state.pool(pool).replicas for pool in POOLS}
