"""The textbook figures around the core sizing, each a pure function that
returns a ``Figure``: its value, unit, the rule in symbols and the rule with
the inputs substituted.

    KV per request        = KV bytes/token x context tokens
    KV for N requests     = N x KV per request
    token demand          input tok/s = rps x input_mean;  output tok/s = rps x output_mean
    prefill FLOPs         = 2 x P x N            (P params, N prompt tokens; per request, x rps per second)
    prefill compute time  = 2 x P x N / (FLOP/s x tp x mfu)     (the linear term only, no attention)
    E2E                   = queue + TTFT + output tokens x TPOT
    active requests       = rps x dwell          (Little's law; dwell = --dwell-s, else E2E at the SLOs)
    prefix cache          shared tok/s = rps x S;  saved tok/s = rps x S x hit_rate
    speculative decoding  speedup = (1 - a^(k+1)) / ((1 - a)(1 + c k)) <= 1/c;   < 1 when a is low
                          (k draft tokens, a acceptance per token, c draft cost / target cost)
    pipeline bubble       = (s - 1) / (m + s - 1)    (GPipe: s stages, m micro-batches)
    cost at capacity      $/M output tokens = $/h / (instance tok/s x 3600) x 1e6
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdcluster.planning.inputs import Accelerator, Deployment, ModelShape, PrefixCache, Slos, Speculation, Traffic


@dataclass(frozen=True)
class Figure:
    key: str  # stable id (JSON, tests); ends in its unit where it has one
    label: str
    value: float
    unit: str  # B, s, tok/s, tokens, requests, instances, FLOP, FLOP/s, $, x, "" (a ratio)
    formula: str  # the rule with the inputs substituted
    rule: str = ""  # the rule in symbols


def g(x: float) -> str:
    """A number as it appears in a formula: integers below 1e12 with commas, else 6 significant digits."""
    if float(x).is_integer() and abs(x) < 1e12:
        return f"{int(x):,}"
    return f"{x:.6g}"


def need(key: str, label: str, value: float, formula: str, rule: str) -> Figure:
    """An instance count: the requirement rounded up (a hair of float error forgiven)."""
    return Figure(key, label, math.ceil(value - 1e-9), "instances", f"ceil({formula} = {g(value)})", f"ceil({rule})")


# --- memory -----------------------------------------------------------------


def kv_per_request(kv_tok: Figure, context_tokens: float) -> Figure:
    return Figure("kv_bytes_per_request", "KV per request (context)", kv_tok.value * context_tokens, "B",
                  f"{g(kv_tok.value)} B x {g(context_tokens)} tokens", "KV bytes/token x context tokens")


def kv_for_concurrency(per_request: Figure, n: int) -> Figure:
    return Figure("kv_bytes_concurrent", f"KV for {n:,} concurrent requests", n * per_request.value, "B",
                  f"{n:,} x {g(per_request.value)} B", "N x KV per request")


# --- demand -----------------------------------------------------------------


def token_demand(t: Traffic) -> list[Figure]:
    return [
        Figure("input_tok_s", "input token demand", t.peak_rps * t.input_mean, "tok/s",
               f"rps {g(t.peak_rps)} x input_mean {g(t.input_mean)}", "rps x input_mean"),
        Figure("output_tok_s", "output token demand", t.peak_rps * t.output_mean, "tok/s",
               f"rps {g(t.peak_rps)} x output_mean {g(t.output_mean)}", "rps x output_mean"),
    ]


def prefill_flops(m: ModelShape, a: Accelerator, d: Deployment, t: Traffic) -> list[Figure]:
    per_request = 2 * m.params * t.input_mean
    return [
        Figure("prefill_flops_per_request", "prefill FLOPs per request", per_request, "FLOP",
               f"2 x params {g(m.params)} x input_mean {g(t.input_mean)}", "2 x P x N"),
        Figure("prefill_flops_s", "prefill FLOP/s demand", per_request * t.peak_rps, "FLOP/s",
               f"{g(per_request)} FLOP x rps {g(t.peak_rps)}", "2 x P x N x rps"),
        Figure("prefill_s_flops", "prefill compute time, mean prompt (2PN only)", per_request / (a.flops * d.tp * d.mfu), "s",
               f"{g(per_request)} FLOP / ({g(a.flops)} FLOP/s x tp {d.tp} x mfu {g(d.mfu)})",
               "2 x P x N / (FLOP/s x tp x mfu)"),
    ]


def active_requests(t: Traffic, dwell_s: float, source: str) -> Figure:
    return Figure("active_requests", "active requests (Little)", t.peak_rps * dwell_s, "requests",
                  f"rps {g(t.peak_rps)} x dwell {g(dwell_s)} s ({source})", "rps x dwell")


# --- latency ----------------------------------------------------------------


def e2e(key: str, label: str, queue_s: float, ttft_s: float, output_tokens: float, tpot_s: float,
        ttft_name: str, tpot_name: str) -> Figure:
    return Figure(key, label, queue_s + ttft_s + output_tokens * tpot_s, "s",
                  f"queue {g(queue_s)} s + {ttft_name} {g(ttft_s)} s + output_mean {g(output_tokens)} x {tpot_name} {g(tpot_s)} s",
                  "queue + TTFT + output tokens x TPOT")


def e2e_at_slos(t: Traffic, s: Slos, queue_s: float) -> Figure:
    return e2e("e2e_s_slo", "E2E at the SLO bounds", queue_s, s.ttft_s, t.output_mean, s.tpot_s, "TTFT SLO", "TPOT SLO")


# --- prefix cache -----------------------------------------------------------


def prefix_cache(m: ModelShape, t: Traffic, p: PrefixCache) -> list[Figure]:
    hit_tokens = p.shared_prefix_tokens * p.hit_rate  # prompt tokens not prefilled, per request
    saved_tok_s = t.peak_rps * hit_tokens
    return [
        Figure("prefix_tok_s", "shared-prefix tokens", t.peak_rps * p.shared_prefix_tokens, "tok/s",
               f"rps {g(t.peak_rps)} x shared prefix {g(p.shared_prefix_tokens)}", "rps x S"),
        Figure("prefix_saved_tok_s", "prefill tokens saved by the cache", saved_tok_s, "tok/s",
               f"rps {g(t.peak_rps)} x {g(p.shared_prefix_tokens)} x hit rate {g(p.hit_rate)}", "rps x S x hit_rate"),
        Figure("prefix_saved_fraction", "fraction of prompt tokens saved", hit_tokens / t.input_mean, "",
               f"{g(p.shared_prefix_tokens)} x {g(p.hit_rate)} / input_mean {g(t.input_mean)}", "S x hit_rate / input_mean"),
        Figure("prefill_tok_s_after_cache", "prefill token demand after the cache", t.peak_rps * (t.input_mean - hit_tokens), "tok/s",
               f"rps {g(t.peak_rps)} x (input_mean {g(t.input_mean)} - {g(hit_tokens)})", "rps x (input_mean - S x hit_rate)"),
        Figure("prefix_saved_flops_s", "prefill FLOP/s saved", 2 * m.params * saved_tok_s, "FLOP/s",
               f"2 x params {g(m.params)} x {g(saved_tok_s)} tok/s", "2 x P x saved tok/s"),
    ]


# --- speculative decoding ---------------------------------------------------


def speculation(sp: Speculation, step_s_batch1: float) -> list[Figure]:
    a, k, c = sp.accept, sp.k, sp.cost
    # expected tokens per verification: 1 + a + a^2 + ... + a^k (the target's own token included)
    tokens = k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a)
    cost = 1 + c * k
    speedup = tokens / cost
    return [
        Figure("spec_tokens_per_step", "tokens per verification step", tokens, "tokens",
               f"(1 - {g(a)}^{k + 1}) / (1 - {g(a)})" if a < 1 else f"k {k} + 1 (a = 1)", "(1 - a^(k+1)) / (1 - a)"),
        Figure("spec_cost_per_step", "cost per step, in target passes", cost, "x",
               f"1 + {g(c)} x {k}", "1 + c x k"),
        Figure("spec_speedup", "speculative decoding speedup", speedup, "x",
               f"{g(tokens)} / {g(cost)}", "(1 - a^(k+1)) / ((1 - a)(1 + c k))"),
        Figure("spec_speedup_bound", "speedup bound", 1 / c, "x", f"1 / {g(c)}", "1 / c"),
        Figure("spec_tpot_s_batch1", "TPOT at batch 1 with speculation", step_s_batch1 / speedup, "s",
               f"step(1) {g(step_s_batch1)} s / {g(speedup)}", "step(1) / speedup"),
    ]


# --- pipeline ---------------------------------------------------------------


def pipeline_bubble(stages: int, micro_batches: int) -> list[Figure]:
    span = micro_batches + stages - 1  # slots from the first micro-batch entering to the last leaving
    return [
        Figure("pipeline_bubble", "pipeline bubble (idle fraction)", (stages - 1) / span, "",
               f"({stages} - 1) / ({micro_batches} + {stages} - 1)", "(s - 1) / (m + s - 1)"),
        Figure("pipeline_efficiency", "pipeline efficiency", micro_batches / span, "",
               f"{micro_batches} / ({micro_batches} + {stages} - 1)", "m / (m + s - 1)"),
    ]


# --- cost -------------------------------------------------------------------


def cost_at_capacity(d: Deployment, instance_tok_s: float, source: str) -> Figure:
    value = d.price_per_instance_hour / (instance_tok_s * 3600) * 1e6
    return Figure("cost_per_m_output_at_capacity", "cost per million output tokens, one instance at capacity", value, "$",
                  f"${g(d.price_per_instance_hour)}/h / ({g(instance_tok_s)} tok/s ({source}) x 3600) x 1e6",
                  "$/h / (instance tok/s x 3600) x 1e6")
