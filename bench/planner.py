"""Capacity planning as plain arithmetic: every figure is a pure function of
the inputs and carries its formula with the inputs substituted.

Memory, per device of an instance (TP devices):
    weights/device      = params x weight_bytes / tp
    KV bytes/token      = 2 (K,V) x layers x kv_heads x head_dim x kv_bytes   (MHA: kv_heads = heads)
    KV bytes/token/dev  = 2 x layers x ceil(kv_heads / tp) x head_dim x kv_bytes
    KV budget/device    = memory x (1 - reserve_fraction) - reserve_bytes - weights/device
    KV capacity         = floor(KV budget/device / KV bytes/token/dev)        tokens per instance
    max concurrency     = floor(KV capacity / (ceil(context / block) x block))
    safe concurrency    = floor(max concurrency x safety)
Speed (see perf_model.py for the roofline and the measured models):
    step(B) decode step time at batch B; prefill(n) time for an n-token prompt
    prefill tok/s = input_mean / (prefill(input_mean) - per-request overhead)
    batch B* = min(max_num_seqs, safe concurrency, largest B with step(B) <= TPOT SLO)
    decode tok/s per instance = B* / step(B*)
Instances, per pool, each constraint rounded up, then
    final = ceil(max(throughput, concurrency, KV) x redundancy)
    Little's law: requests in flight L = rps x W, W = the time a request spends in the pool
    prefill  W = prefill(input_mean)
             throughput  = rps x input_mean / prefill tok/s
             concurrency = L / max_num_seqs
             KV          = L x input_mean / (KV capacity x safety)
    decode   W = output_mean x step(B*)
             throughput  = rps x output_mean / decode tok/s
             concurrency = L / B*          (agrees with throughput: a check on L)
             KV          = L x (input_mean + output_mean / 2) / (KV capacity x safety)
    Headroom for queueing and failures is the explicit redundancy factor.
Cost: $/M input tokens  = prefill instances x $/h / (rps x input_mean x 3600) x 1e6
      $/M output tokens = decode instances  x $/h / (rps x output_mean x 3600) x 1e6
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench.perf_model import PrefillModel, StepModel, roofline_prefill, roofline_step
from bench.plan_inputs import Accelerator, Deployment, ModelShape, Slos, Traffic


@dataclass(frozen=True)
class Figure:
    key: str  # stable id (JSON, tests)
    label: str
    value: float
    unit: str
    formula: str  # with the inputs substituted


@dataclass(frozen=True)
class PoolSize:
    pool: str  # "prefill" or "decode"
    throughput: int
    concurrency: int
    kv: int
    final: int  # ceil(max(...) x redundancy)

    @property
    def binding(self) -> str:
        needs = {"throughput": self.throughput, "concurrency": self.concurrency, "KV": self.kv}
        return max(needs, key=needs.get)


@dataclass(frozen=True)
class Plan:
    sections: list[tuple[str, list[Figure]]]
    prefill: PoolSize
    decode: PoolSize
    batch: int  # recommended decode batch per instance
    decode_tok_s: float  # per decode instance at that batch
    warnings: list[str] = field(default_factory=list)

    def figure(self, key: str) -> Figure:
        for _, figures in self.sections:
            for fig in figures:
                if fig.key == key:
                    return fig
        raise KeyError(key)

    def value(self, key: str) -> float:
        return self.figure(key).value


def g(x: float) -> str:
    """A number as it appears in a formula: integers with commas, else 6 significant digits."""
    if float(x).is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"
    return f"{x:.6g}"


# --- memory ---------------------------------------------------------------


def weights_per_device(m: ModelShape, d: Deployment) -> Figure:
    value = m.params * d.weight_bytes / d.tp
    return Figure("weights_per_device_bytes", "weights per device", value, "B",
                  f"params {g(m.params)} x {g(d.weight_bytes)} B / tp {d.tp}")


def kv_bytes_per_token(m: ModelShape, d: Deployment, kv_heads: int | None = None, key: str = "kv_bytes_per_token") -> Figure:
    heads = m.num_kv_heads if kv_heads is None else kv_heads
    value = 2 * m.num_layers * heads * m.head_dim * d.kv_bytes
    label = "KV bytes per token (instance)" if kv_heads is None else "KV bytes per token if MHA"
    return Figure(key, label, value, "B",
                  f"2 x layers {m.num_layers} x kv_heads {heads} x head_dim {m.head_dim} x {g(d.kv_bytes)} B")


def kv_bytes_per_token_device(m: ModelShape, d: Deployment) -> Figure:
    heads = math.ceil(m.num_kv_heads / d.tp)
    value = 2 * m.num_layers * heads * m.head_dim * d.kv_bytes
    return Figure("kv_bytes_per_token_device", "KV bytes per token per device", value, "B",
                  f"2 x layers {m.num_layers} x ceil(kv_heads {m.num_kv_heads} / tp {d.tp}) x head_dim {m.head_dim} x {g(d.kv_bytes)} B")


def kv_budget_per_device(a: Accelerator, d: Deployment, weights: Figure) -> Figure:
    value = a.memory_bytes * (1 - d.reserve_fraction) - d.reserve_bytes - weights.value
    formula = (f"memory {g(a.memory_bytes)} B x (1 - reserve {g(d.reserve_fraction)}) - reserve {g(d.reserve_bytes)} B"
               f" - weights {g(weights.value)} B")
    if value <= 0:
        raise ValueError(f"no memory left for KV on {a.name}: {formula} = {g(value)} B; "
                         f"raise --tp, use a smaller --weight-dtype, or lower --reserve-fraction")
    return Figure("kv_budget_per_device_bytes", "KV budget per device", value, "B", formula)


def kv_capacity_tokens(budget: Figure, kv_dev: Figure) -> Figure:
    value = math.floor(budget.value / kv_dev.value)
    return Figure("kv_capacity_tokens", "KV capacity per instance", value, "tokens",
                  f"floor({g(budget.value)} B / {g(kv_dev.value)} B per token)")


def max_concurrency(capacity: Figure, context_tokens: float, d: Deployment) -> tuple[Figure, Figure]:
    blocks = math.ceil(context_tokens / d.block_size)
    theoretical = math.floor(capacity.value / (blocks * d.block_size))
    safe = math.floor(theoretical * d.safety)
    return (
        Figure("max_concurrency", "theoretical max concurrency", theoretical, "requests",
               f"floor({g(capacity.value)} tokens / (ceil({g(context_tokens)} / block {d.block_size}) x {d.block_size}))"),
        Figure("safe_concurrency", "safe max concurrency", safe, "requests",
               f"floor({theoretical} x safety {g(d.safety)})"),
    )


# --- speed ----------------------------------------------------------------


def recommended_batch(step: StepModel, slos: Slos, safe_concurrency: int, d: Deployment) -> Figure:
    within_slo = step.max_batch_within(slos.tpot_s)
    value = max(1, min(d.max_num_seqs, safe_concurrency, within_slo))
    return Figure("batch", "recommended decode batch B*", value, "requests",
                  f"max(1, min(max_num_seqs {d.max_num_seqs}, safe concurrency {safe_concurrency}, "
                  f"largest B with step(B) <= TPOT {g(slos.tpot_s)} s: {within_slo}))")


def decode_tok_s(step: StepModel, batch: int) -> Figure:
    step_s = step.step_s(batch)
    return Figure("decode_tok_s", "decode tok/s per instance at B*", batch / step_s, "tok/s",
                  f"B* {batch} / step({batch}) {g(step_s)} s   [{step.describe(batch)}]")


def bandwidth_bound_tok_s(m: ModelShape, a: Accelerator, weights: Figure) -> Figure:
    return Figure("decode_bound_tok_s", "decode tok/s upper bound, batch 1 (peak bandwidth)",
                  a.bandwidth_bytes_s / weights.value, "tok/s",
                  f"bandwidth {g(a.bandwidth_bytes_s)} B/s / weights per device {g(weights.value)} B")


def prefill_time(prefill: PrefillModel, tokens: float, key: str, label: str) -> Figure:
    return Figure(key, label, prefill.time_s(tokens), "s", prefill.describe(tokens))


def prefill_tok_s(prefill: PrefillModel, input_mean: float) -> Figure:
    """Compute throughput: the fixed per-request overhead (HTTP, routing, KV
    hand-off) adds latency but does not occupy the prefill instance."""
    t = prefill.time_s(input_mean) - prefill.overhead_s
    return Figure("prefill_tok_s", "prefill tok/s per instance (mean prompt)", input_mean / t, "tok/s",
                  f"input_mean {g(input_mean)} / (prefill({g(input_mean)}) - overhead {g(prefill.overhead_s)} s) = "
                  f"{g(input_mean)} / {g(t)} s")


# --- instances ------------------------------------------------------------


def _need(key: str, label: str, value: float, formula: str) -> Figure:
    return Figure(key, label, math.ceil(value - 1e-9), "instances", f"ceil({formula} = {g(value)})")


def final_instances(pool: str, needs: list[Figure], d: Deployment) -> tuple[PoolSize, Figure]:
    largest = max(f.value for f in needs)
    final = math.ceil(largest * d.redundancy - 1e-9)
    fig = Figure(f"{pool}_instances", f"{pool} instances", final, "instances",
                 f"ceil(max({', '.join(g(f.value) for f in needs)}) x redundancy {g(d.redundancy)})")
    size = PoolSize(pool, *(int(f.value) for f in needs), final=final)
    return size, fig


def prefill_needs(t: Traffic, d: Deployment, rate: Figure, prefill_mean: Figure, capacity: Figure) -> list[Figure]:
    in_flight = t.peak_rps * prefill_mean.value
    little = f"L = rps {g(t.peak_rps)} x W {g(prefill_mean.value)} s"
    return [
        _need("prefill_by_throughput", "prefill by throughput", t.peak_rps * t.input_mean / rate.value,
              f"rps {g(t.peak_rps)} x input_mean {g(t.input_mean)} / {g(rate.value)} tok/s"),
        _need("prefill_by_concurrency", "prefill by concurrency (Little)", in_flight / d.max_num_seqs,
              f"{little} = {g(in_flight)} / max_num_seqs {d.max_num_seqs}"),
        _need("prefill_by_kv", "prefill by KV", in_flight * t.input_mean / (capacity.value * d.safety),
              f"{little} x input_mean {g(t.input_mean)} / ({g(capacity.value)} tokens x safety {g(d.safety)})"),
    ]


def decode_needs(t: Traffic, d: Deployment, tok_s: Figure, batch: Figure, step_s: float, capacity: Figure) -> list[Figure]:
    w = t.output_mean * step_s
    in_flight = t.peak_rps * w
    little = f"L = rps {g(t.peak_rps)} x W (output_mean {g(t.output_mean)} x step {g(step_s)} s)"
    context = t.input_mean + t.output_mean / 2
    return [
        _need("decode_by_throughput", "decode by throughput", t.peak_rps * t.output_mean / tok_s.value,
              f"rps {g(t.peak_rps)} x output_mean {g(t.output_mean)} / {g(tok_s.value)} tok/s"),
        _need("decode_by_concurrency", "decode by concurrency (Little)", in_flight / batch.value,
              f"{little} = {g(in_flight)} / B* {g(batch.value)}"),
        _need("decode_by_kv", "decode by KV", in_flight * context / (capacity.value * d.safety),
              f"{little} x (input_mean {g(t.input_mean)} + output_mean {g(t.output_mean)} / 2) / "
              f"({g(capacity.value)} tokens x safety {g(d.safety)})"),
    ]


def cost_per_million(pool: str, instances: int, tokens_s: float, d: Deployment, what: str) -> Figure:
    value = instances * d.price_per_instance_hour / (tokens_s * 3600) * 1e6 if tokens_s > 0 else float("nan")
    return Figure(f"cost_per_m_{what}", f"cost per million {what} tokens", value, "$",
                  f"{pool} instances {instances} x ${g(d.price_per_instance_hour)}/h / ({g(tokens_s)} tok/s x 3600) x 1e6")


# --- the whole plan -------------------------------------------------------


def _checks(m: ModelShape, t: Traffic, s: Slos, context: float, safe: Figure, step: StepModel, prefill_p95: Figure) -> list[str]:
    warnings = []
    if m.max_context and context > m.max_context:
        warnings.append(f"context {g(context)} tokens exceeds the model's {m.max_context}: cap the request lengths")
    if safe.value < 1:
        warnings.append(f"not one request of {g(context)} tokens fits the KV budget safely: raise --tp or memory, or shorten requests")
    if step.step_s(1) > s.tpot_s:
        warnings.append(f"TPOT SLO {g(s.tpot_s)} s is unreachable even at batch 1 (step {step.step_s(1):.4g} s): "
                        f"raise --tp, use faster hardware, or relax --tpot")
    if prefill_p95.value > s.ttft_s:
        warnings.append(f"prefill of a p95 prompt ({g(t.input_p95)} tokens) takes {prefill_p95.value:.4g} s > TTFT SLO "
                        f"{g(s.ttft_s)} s before any queueing: raise --tp or relax --ttft")
    return warnings


def make_plan(
    m: ModelShape,
    a: Accelerator,
    d: Deployment,
    t: Traffic,
    s: Slos,
    *,
    context_tokens: float | None = None,
    step: StepModel | None = None,
    prefill: PrefillModel | None = None,
) -> Plan:
    """The plan; ``step``/``prefill`` replace the roofline models with measured ones."""
    weights = weights_per_device(m, d)
    kv_tok = kv_bytes_per_token(m, d)
    kv_mha = kv_bytes_per_token(m, d, kv_heads=m.num_heads, key="kv_bytes_per_token_mha")
    kv_dev = kv_bytes_per_token_device(m, d)
    budget = kv_budget_per_device(a, d, weights)
    capacity = kv_capacity_tokens(budget, kv_dev)
    context = context_tokens if context_tokens is not None else t.input_p95 + t.output_p95
    theoretical, safe = max_concurrency(capacity, context, d)
    step = step or roofline_step(m, a, d, weights.value, kv_dev.value, t.input_mean + t.output_mean / 2)
    prefill = prefill or roofline_prefill(m, a, d)
    batch = recommended_batch(step, s, int(safe.value), d)
    tok_s = decode_tok_s(step, int(batch.value))
    prefill_mean = prefill_time(prefill, t.input_mean, "prefill_s_mean", "prefill time, mean prompt")
    prefill_p95 = prefill_time(prefill, t.input_p95, "prefill_s_p95", "prefill time, p95 prompt")
    rate = prefill_tok_s(prefill, t.input_mean)
    p_needs = prefill_needs(t, d, rate, prefill_mean, capacity)
    d_needs = decode_needs(t, d, tok_s, batch, step.step_s(batch.value), capacity)
    p_size, p_final = final_instances("prefill", p_needs, d)
    d_size, d_final = final_instances("decode", d_needs, d)
    p_work, d_work = t.peak_rps * t.input_mean / rate.value, t.peak_rps * t.output_mean / tok_s.value
    load_ratio = Figure("prefill_decode_load_ratio", "prefill : decode busy instances", p_work / d_work, "",
                        f"(rps x input_mean / prefill tok/s = {g(p_work)}) / (rps x output_mean / decode tok/s = {g(d_work)})")
    ratio = Figure("prefill_decode_ratio", "prefill : decode replicas", p_size.final / d_size.final, "",
                   f"{p_size.final} : {d_size.final}")
    memory = [
        weights, kv_tok, kv_mha,
        Figure("gqa_saving", "KV saving of GQA over MHA", kv_mha.value / kv_tok.value, "x",
               f"heads {m.num_heads} / kv_heads {m.num_kv_heads}"),
        kv_dev, budget, capacity,
        Figure("context_tokens", "context per request", context, "tokens", "input_p95 + output_p95" if context_tokens is None else "--context"),
        theoretical, safe,
    ]
    speed = [
        bandwidth_bound_tok_s(m, a, weights),
        Figure("step_s_batch1", "decode step, batch 1", step.step_s(1), "s", step.describe(1)),
        batch,
        Figure("step_s_batch", "decode step (TPOT) at B*", step.step_s(batch.value), "s", step.describe(batch.value)),
        tok_s, prefill_mean, prefill_p95, rate,
    ]
    instances = [*p_needs, p_final, *d_needs, d_final, load_ratio, ratio]
    cost = [
        cost_per_million("prefill", p_size.final, t.peak_rps * t.input_mean, d, "input"),
        cost_per_million("decode", d_size.final, t.peak_rps * t.output_mean, d, "output"),
        Figure("cost_per_hour", "fleet cost per hour", (p_size.final + d_size.final) * d.price_per_instance_hour, "$",
               f"({p_size.final} + {d_size.final}) instances x ${g(d.price_per_instance_hour)}/h"),
    ]
    sections = [("memory", memory), ("speed", speed), ("instances", instances), ("cost", cost)]
    return Plan(sections, p_size, d_size, int(batch.value), tok_s.value, _checks(m, t, s, context, safe, step, prefill_p95))
