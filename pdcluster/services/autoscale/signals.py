"""What the autoscaler measures, from one source: the gateway's own
``GET /metrics`` (pdcluster/services/openai/gateway_metrics.py), which carries both
the gateway's view (admission queue, client-side TTFT/TPOT, tokens
streamed, answers) and every replica's status-board numbers.

    Scrape       one parse of the text: counters, gauges, histogram buckets
    window       the scrapes of the last ``window_s`` seconds
    measurements (first, last) differences over the window's seconds:
                   arrivals     = answers + change in requests in flight
                   arrival_rps  = arrivals / seconds
                   prompt mean  = prompt tokens admitted / requests admitted (the gateway's
                                  count: right whichever pool prefills, a prefill pool at zero too)
                   output tok/s = tokens streamed / seconds
                   output mean  = tokens streamed / requests answered (over the window; since the
                                  gateway started when the window answered none): with the arrival
                                  rate, the demand an overloaded pool cannot show in what it streams
                   p90          = from the histogram's bucket differences (linear within a bucket)
                   mean TPOT    = the histogram's sum difference / its count difference
                 window means of the gauges: decode sequences (running + waiting), queued prompt tokens
                 (awaiting a first token, in either pool)

Every counter read is the gateway's own, so replicas that come and go
(a pool scaled to zero and back) never make a difference jump."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pdcluster.services.autoscale.policy import Measurements, PoolMeasurement

_ANSWERED_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class Scrape:
    t_s: float
    answered: float = 0.0
    in_flight: float = 0.0
    generated_tokens: float = 0.0
    admitted: float = 0.0
    admitted_prompt_tokens: float = 0.0
    queued_tokens: dict[str, float] = field(default_factory=dict)  # pool -> gauge
    decode_sequences: float = 0.0
    replicas: dict[str, int] = field(default_factory=dict)  # pool -> replicas reporting
    ttft_buckets: tuple[tuple[float, float], ...] = ()  # (upper bound, cumulative count)
    tpot_buckets: tuple[tuple[float, float], ...] = ()
    tpot_sum_s: float = 0.0


def parse_scrape(text: str, t_s: float) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    answered = in_flight = generated = sequences = tpot_sum = admitted = prompt = 0.0
    queued, replicas = {}, {}
    buckets: dict[str, list[tuple[float, float]]] = {"ttft": [], "tpot": []}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, s.value
            if name == "pdcluster_http_responses_total" and labels.get("endpoint") in _ANSWERED_ENDPOINTS:
                answered += value
            elif name == "pdcluster_admission_in_flight":
                in_flight = value
            elif name == "pdcluster_generation_tokens_total":
                generated += value
            elif name == "pdcluster_admission_queued_tokens":
                queued[labels["pool"]] = value
            elif name == "pdcluster_admission_admitted_total":
                admitted = value
            elif name == "pdcluster_admission_prompt_tokens_total":
                prompt = value
            elif name in ("pdcluster_requests_running", "pdcluster_requests_waiting"):
                if labels.get("pool") == "decode":
                    sequences += value
                if name == "pdcluster_requests_running":
                    replicas[labels["pool"]] = replicas.get(labels["pool"], 0) + 1
            elif name == "pdcluster_tpot_seconds_sum":
                tpot_sum = value
            elif name in ("pdcluster_ttft_seconds_bucket", "pdcluster_tpot_seconds_bucket"):
                buckets[name.split("_")[1]].append((float(labels["le"]), value))
    return Scrape(t_s, answered, in_flight, generated, admitted, prompt, queued, sequences, replicas,
                  tuple(sorted(buckets["ttft"])), tuple(sorted(buckets["tpot"])), tpot_sum)


def p90(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]) -> tuple[float | None, int]:
    """The 90th percentile of the observations between two scrapes of a
    histogram, and how many there were; None when there were none."""
    old = dict(before)
    counts = [(le, c - old.get(le, 0.0)) for le, c in after]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None, 0
    rank, lower, below = 0.9 * total, 0.0, 0.0
    for le, cumulative in counts:
        if cumulative >= rank:
            if le == float("inf"):
                return lower, int(total)
            share = (rank - below) / max(cumulative - below, 1e-12)
            return lower + (le - lower) * share, int(total)
        lower, below = le, cumulative
    return lower, int(total)


def measurements(window: Sequence[Scrape], now_s: float) -> Measurements | None:
    """None until the window holds two scrapes."""
    if len(window) < 2:
        return None
    first, last = window[0], window[-1]
    seconds = max(last.t_s - first.t_s, 1e-6)
    arrivals = max(last.answered - first.answered + last.in_flight - first.in_flight, 0.0)
    admitted = max(last.admitted - first.admitted, 0.0)
    prompt_tokens = max(last.admitted_prompt_tokens - first.admitted_prompt_tokens, 0.0)
    ttft, ttft_n = p90(first.ttft_buckets, last.ttft_buckets)
    tpot, tpot_n = p90(first.tpot_buckets, last.tpot_buckets)
    queued = sum(sum(s.queued_tokens.values()) for s in window) / len(window)
    sequences = sum(s.decode_sequences for s in window) / len(window)
    tpot_mean = (last.tpot_sum_s - first.tpot_sum_s) / tpot_n if tpot_n else None
    generated, answered = last.generated_tokens - first.generated_tokens, last.answered - first.answered
    if answered < 1:
        generated, answered = last.generated_tokens, last.answered
    output_mean = max(generated, 0.0) / answered if answered >= 1 else 0.0
    return Measurements(
        now_s=now_s, arrival_rps=arrivals / seconds,
        prompt_tokens_mean=prompt_tokens / admitted if admitted else 0.0,
        output_tok_s=max(last.generated_tokens - first.generated_tokens, 0.0) / seconds,
        prefill=PoolMeasurement(queued_tokens=queued, latency_p90_s=ttft, latency_samples=ttft_n),
        decode=PoolMeasurement(sequences=sequences, latency_p90_s=tpot, latency_samples=tpot_n,
                               latency_mean_s=tpot_mean, replicas=last.replicas.get("decode", 0)),
        output_tokens_mean=output_mean)
