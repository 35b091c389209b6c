"""The autoscaler's signals (parsed from the gateway's /metrics text) and
its controller loop, against a fake cluster and a scripted scrape: no Ray."""

from __future__ import annotations

import json

import pytest

from pdcluster.services.autoscale.log import entry, format_recent
from pdcluster.services.autoscale.signals import measurements, p90, parse_scrape
from pdcluster.services.autoscale.controller import Autoscaler
from pdcluster.services.config import AutoscalePoolBounds, AutoscaleSpeed, AutoscalingSettings, ClusterConfig

TPOT_LE = (0.05, 0.075, 0.1, 0.15, float("inf"))


def metrics_text(*, answered: int, in_flight: int, generated: int, admitted: int, prompt: int, queued: int,
                 decode_running: list[int], tpot_counts: tuple[int, ...] = (0, 0, 0, 0, 0), tpot_sum: float = 1.0) -> str:
    """The lines of pdcluster/services/openai/gateway_metrics.py the autoscaler reads."""
    lines = ["# TYPE pdcluster_http_responses_total counter",
             f'pdcluster_http_responses_total{{endpoint="/v1/completions",status_class="2xx"}} {answered}',
             f'pdcluster_http_responses_total{{endpoint="/metrics",status_class="2xx"}} 99',
             "# TYPE pdcluster_admission_in_flight gauge", f"pdcluster_admission_in_flight {in_flight}",
             "# TYPE pdcluster_generation_tokens_total counter", f"pdcluster_generation_tokens_total {generated}",
             "# TYPE pdcluster_admission_queued_tokens gauge",
             f'pdcluster_admission_queued_tokens{{pool="prefill"}} {queued}',
             f'pdcluster_admission_queued_tokens{{pool="decode"}} {queued // 2}',
             "# TYPE pdcluster_admission_admitted_total counter", f"pdcluster_admission_admitted_total {admitted}",
             "# TYPE pdcluster_admission_prompt_tokens_total counter",
             f"pdcluster_admission_prompt_tokens_total {prompt}",
             "# TYPE pdcluster_prompt_tokens_total counter",  # the replicas' own count: not the autoscaler's
             'pdcluster_prompt_tokens_total{pool="prefill",replica="p0"} 123456']
    lines += ["# TYPE pdcluster_requests_running gauge"]
    lines += [f'pdcluster_requests_running{{pool="decode",replica="d{i}"}} {n}' for i, n in enumerate(decode_running)]
    lines += ['pdcluster_requests_running{pool="prefill",replica="p0"} 1', "# TYPE pdcluster_requests_waiting gauge",
              'pdcluster_requests_waiting{pool="decode",replica="d0"} 1', "# TYPE pdcluster_tpot_seconds histogram"]
    cumulative = 0
    for le, n in zip(TPOT_LE, tpot_counts):
        cumulative += n
        lines.append(f'pdcluster_tpot_seconds_bucket{{le="{"+Inf" if le == float("inf") else le}"}} {cumulative}')
    lines += [f"pdcluster_tpot_seconds_count {cumulative}", f"pdcluster_tpot_seconds_sum {tpot_sum}"]
    return "\n".join(lines) + "\n"


def test_parse_scrape_reads_what_the_rule_needs():
    s = parse_scrape(metrics_text(answered=10, in_flight=3, generated=400, admitted=13, prompt=700,
                                  queued=96, decode_running=[2, 3], tpot_counts=(1, 2, 3, 4, 0)), 5.0)
    assert (s.answered, s.in_flight, s.generated_tokens) == (10, 3, 400)
    assert (s.admitted, s.admitted_prompt_tokens) == (13, 700)
    assert s.queued_tokens == {"prefill": 96, "decode": 48}
    assert s.decode_sequences == 2 + 3 + 1  # running on both decode replicas + waiting
    assert s.replicas == {"decode": 2, "prefill": 1}
    assert s.tpot_buckets == ((0.05, 1), (0.075, 3), (0.1, 6), (0.15, 10), (float("inf"), 10))


def test_p90_interpolates_within_the_bucket_of_the_window_only():
    before = ((0.05, 10), (0.1, 10), (0.2, 10), (float("inf"), 10))
    after = ((0.05, 10), (0.1, 15), (0.2, 20), (float("inf"), 20))  # 10 new: 5 in (0.05, 0.1], 5 in (0.1, 0.2]
    assert p90(before, after) == (pytest.approx(0.18), 10)  # rank 9: 4 of the 5 in the second bucket
    assert p90(after, after) == (None, 0)


def test_measurements_are_window_differences_and_gauge_means():
    first = parse_scrape(metrics_text(answered=10, in_flight=2, generated=100, admitted=12, prompt=1000, queued=0,
                                      decode_running=[1]), 0.0)
    last = parse_scrape(metrics_text(answered=30, in_flight=4, generated=700, admitted=34, prompt=2100, queued=200,
                                     decode_running=[5], tpot_counts=(8, 1, 1, 0, 0), tpot_sum=1.5), 10.0)
    m = measurements([first, last], now_s=10.0)
    assert m.arrival_rps == pytest.approx(2.2)  # (20 answered + 2 more in flight) / 10 s
    assert m.prompt_tokens_mean == pytest.approx(50.0)  # 1100 tokens / 22 admitted, whichever pool prefilled
    assert m.output_tok_s == pytest.approx(60.0)
    assert m.prefill.queued_tokens == 150 and m.decode.sequences == (2 + 6) / 2  # both pools' queues, mean
    assert m.decode.latency_samples == 10 and m.decode.latency_p90_s == pytest.approx(0.075)
    assert m.decode.latency_mean_s == pytest.approx(0.05) and m.decode.replicas == 1  # 0.5 s over 10 requests
    assert m.output_tokens_mean == pytest.approx(30.0)  # 600 tokens / 20 answered in the window
    assert measurements([first], 0.0) is None


def test_the_output_mean_falls_back_to_the_gateways_lifetime_when_the_window_answered_none():
    first = parse_scrape(metrics_text(answered=10, in_flight=0, generated=300, admitted=10, prompt=500, queued=0,
                                      decode_running=[1]), 0.0)
    busy = parse_scrape(metrics_text(answered=10, in_flight=6, generated=420, admitted=16, prompt=800, queued=0,
                                     decode_running=[6]), 10.0)
    assert measurements([first, busy], 10.0).output_tokens_mean == pytest.approx(42.0)  # 420 / 10, since start
    empty = parse_scrape(metrics_text(answered=0, in_flight=0, generated=0, admitted=0, prompt=0, queued=0,
                                      decode_running=[0]), 0.0)
    assert measurements([empty, empty], 1.0).output_tokens_mean == 0.0


class FakeCluster:
    def __init__(self, config: ClusterConfig):
        self.config, self.applied = config, []

    def apply(self, config: ClusterConfig) -> None:
        self.config = config
        self.applied.append((config.prefill.num_replicas, config.decode.num_replicas))


class Script:
    """Cumulative counters of a load that the test changes between ticks."""

    def __init__(self):
        self.t, self.answered, self.generated, self.prompt = 0.0, 0, 0, 0
        self.rps, self.running = 1.0, 1

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.answered += round(self.rps * seconds)
        self.generated += round(self.rps * seconds * 20)
        self.prompt += round(self.rps * seconds * 10)  # 10-token prompts: one prefill replica suffices

    def text(self) -> str:
        return metrics_text(answered=self.answered, in_flight=0, generated=self.generated, admitted=self.answered,
                            prompt=self.prompt,
                            queued=0, decode_running=[self.running])


def test_controller_scales_up_on_a_peak_and_back_down_after_it():
    speed = AutoscaleSpeed(prefill_overhead_s=0.15, prefill_per_token_s=0.012, step_base_s=0.045, step_per_seq_s=0.008)
    settings = AutoscalingSettings(enabled=True, window_s=9, up_cooldown_s=10, down_cooldown_s=20, down_stable_s=15,
                                   speed=speed, prefill=AutoscalePoolBounds(min_replicas=1, max_replicas=2))
    cluster = FakeCluster(ClusterConfig(autoscaling=settings))
    script = Script()
    scaler = Autoscaler(cluster, fetch=script.text, clock=lambda: script.t)
    scaler._record = lambda decisions, m: None  # no Redis here
    # B* = (0.07 - 0.045) / 0.008 = 3, 3 / 0.069 = 43.5 tok/s per replica x 0.8 = 34.8
    for rps, running, seconds in ((1.0, 1, 30), (5.0, 6, 40), (1.0, 1, 90)):  # 20, 100, 20 tok/s
        script.rps, script.running = rps, running
        for _ in range(int(seconds / 3)):
            script.advance(3)
            scaler.tick()
    # decode up to 3 (100 / 34.8 = 2.9) as the peak fills the window, then down once it is over
    assert cluster.applied == [(1, 2), (1, 3), (1, 1)]
    assert cluster.config.decode.num_replicas == 1 and cluster.config.prefill.num_replicas == 1
    moves = [(t, d.pool, d.direction) for t, ds in scaler.history for d in ds if d.direction != "hold"]
    assert [m[1:] for m in moves] == [("decode", "up"), ("decode", "up"), ("decode", "down")]
    assert moves[0][0] == 33 and moves[1][0] == 45  # the first peak scrape; the up-scale cool-down after it


def test_controller_takes_the_prefill_pool_to_zero_at_low_load_and_back_for_the_peak():
    speed = AutoscaleSpeed(prefill_overhead_s=0.15, prefill_per_token_s=0.012, step_base_s=0.045, step_per_seq_s=0.008)
    settings = AutoscalingSettings(enabled=True, window_s=9, up_cooldown_s=10, down_cooldown_s=20, down_stable_s=15,
                                   speed=speed)  # prefill min_replicas 0: the default
    cluster = FakeCluster(ClusterConfig(autoscaling=settings))
    script = Script()
    scaler = Autoscaler(cluster, fetch=script.text, clock=lambda: script.t)
    scaler._record = lambda decisions, m: None
    # 10-token prompts take 0.12 s of prefill: 1 req/s is 0.12 of a decode replica (<= 0.2), 5 req/s 0.6
    for rps, running, seconds in ((1.0, 1, 30), (5.0, 6, 40), (1.0, 1, 120)):
        script.rps, script.running = rps, running
        for _ in range(int(seconds / 3)):
            script.advance(3)
            scaler.tick()
    prefill = [p for p, _ in cluster.applied]
    assert prefill[0] == 0 and 1 in prefill and prefill[-1] == 0  # away, back for the peak, away again
    assert cluster.config.prefill.num_replicas == 0 and cluster.config.decode.num_replicas == 1
    peak = [t for t, ds in scaler.history for d in ds if d.pool == "prefill" and d.direction == "up"]
    assert peak and 30 <= peak[0] <= 45  # within the peak's first window


def test_controller_refuses_colocated_mode():
    with pytest.raises(ValueError, match="autoscaling sizes the prefill and decode pools apart"):
        ClusterConfig(mode="colocated", autoscaling=AutoscalingSettings(enabled=True))
    with pytest.raises(ValueError, match="mode colocated has neither"):
        Autoscaler(FakeCluster(ClusterConfig(mode="colocated")), fetch=lambda: "")


def test_settings_refuse_min_over_max():
    with pytest.raises(ValueError, match="autoscaling.decode: min_replicas 3 > max_replicas 2"):
        AutoscalingSettings(decode={"min_replicas": 3, "max_replicas": 2})


@pytest.mark.parametrize("interval", [0.0, 1e-320, 0.49, float("nan"), -2.0])
def test_settings_refuse_an_interval_that_would_hammer_the_gateway(interval):
    with pytest.raises(ValueError, match="interval_s"):
        AutoscalingSettings(interval_s=interval)


def test_the_record_is_json_and_reads_as_one_line_per_pool():
    from pdcluster.services.autoscale.policy import Measurements, PoolDecision

    decisions = [PoolDecision("prefill", 1, 1, 1, "within the band"), PoolDecision("decode", 1, 2, 2, "wanted 2: ...")]
    item = json.loads(json.dumps(entry(decisions, Measurements(0.0, 2.0, 50.0, 100.0), wall_time=0.0)))
    lines = format_recent([item])
    assert len(lines) == 2 and "decode   UP   1->2 (need 2; 2.00 req/s, 100 tok/s): wanted 2" in lines[1]


def test_status_prints_the_last_decisions_when_an_autoscaler_runs(monkeypatch, capsys):
    from pdcluster.services.autoscale import log as autoscale_log
    from pdcluster.services.cli import status as cli_status
    from pdcluster.services.autoscale.policy import Measurements, PoolDecision

    item = entry([PoolDecision("decode", 2, 1, 1, "x1.3 demand needs 1 for 20 s")], Measurements(0.0, 0.5, 30.0, 15.0),
                 wall_time=0.0)
    monkeypatch.setattr(autoscale_log, "read_recent", lambda url, cluster: [item])
    cli_status.print_autoscale({"redis_url": "redis://x", "cluster": "local"})
    out = capsys.readouterr().out
    assert out.startswith("autoscaler, last decisions") and "decode   DOWN 2->1 (need 1" in out
    monkeypatch.setattr(autoscale_log, "read_recent", lambda url, cluster: [])
    cli_status.print_autoscale({"redis_url": "redis://x"})
    assert capsys.readouterr().out == ""


def test_only_a_pool_going_to_zero_is_published_before_the_deploy():
    from pdcluster.services.pools.pool_targets import publish_first, targets_of

    assert publish_first({"prefill": 1, "decode": 1}, {"prefill": 0, "decode": 1})
    assert not publish_first({"prefill": 0, "decode": 1}, {"prefill": 1, "decode": 1})  # live first, then publish
    assert not publish_first({"prefill": 2, "decode": 1}, {"prefill": 1, "decode": 3})
    assert not publish_first({"prefill": 0}, {"prefill": 0})
    config = ClusterConfig(prefill={"num_replicas": 0}, decode={"num_replicas": 2})
    assert targets_of(config) == {"prefill": 0, "decode": 2}
    assert targets_of(ClusterConfig(mode="colocated")) == {"colocated": 2}


@pytest.mark.parametrize("pools,message", [
    ({"decode": {"num_replicas": 0}}, "decode.num_replicas must be >= 1"),
    ({"mode": "colocated", "colocated": {"num_replicas": 0}}, "colocated.num_replicas must be >= 1"),
    ({"autoscaling": {"decode": {"min_replicas": 0, "max_replicas": 2}}}, "decode.min_replicas must be >= 1"),
    ({"autoscaling": {"prefill": {"min_replicas": 0, "max_replicas": 0}}}, "prefill.max_replicas\n.*greater than or equal to 1"),
])
def test_only_the_prefill_pool_may_be_empty(pools, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**pools)
