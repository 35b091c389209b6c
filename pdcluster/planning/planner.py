"""Capacity planning as plain arithmetic: every figure is a pure function of
the inputs and carries its rule, in symbols and with the inputs substituted.
This file is the core sizing; plan_memory.py the memory arithmetic,
plan_figures.py the textbook figures around it and plan_fleet.py the sizing
from measured per-instance facts.

Memory (plan_memory.py): weights/device, KV bytes/token, the KV budget, KV
capacity and the max and safe concurrency it allows (< 1 request: an error).
Speed (see speed.py for the roofline and the measured models):
    step(B) decode step time at batch B; prefill(n) time for an n-token prompt
    decode ceiling, batch 1 = bandwidth / weights per device
    prefill tok/s = input_mean / (prefill(input_mean) - per-request overhead)
    batch B* = min(max_num_seqs, safe concurrency, largest B with step(B) <= TPOT SLO)
    decode tok/s per instance = B* / step(B*)
Instances, per pool, each constraint rounded up, then
    final = ceil(max(throughput, concurrency, KV) x redundancy)
    Little's law: requests in flight L = rps x W, W = the time a request spends in the pool
    prefill  W = prefill(input_mean)
             throughput  = rps x (input_mean - prefix tokens cached) / prefill tok/s
             concurrency = L / max_num_seqs
             KV          = L x input_mean / (KV capacity x safety)
    decode   W = output_mean x step(B*)
             throughput  = rps x output_mean / decode tok/s
             concurrency = L / B*          (equals throughput by Little's law: a check on L, never binding alone;
                                            plan_fleet.py sizes from independent measurements)
             KV          = L x (input_mean + output_mean / 2) / (KV capacity x safety)
    Headroom for queueing and failures is the explicit redundancy factor.
Cost: $/M input tokens  = prefill instances x $/h / (rps x input_mean x 3600) x 1e6
      $/M output tokens = decode instances  x $/h / (rps x output_mean x 3600) x 1e6
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdcluster.planning import figures as fig
from pdcluster.planning.figures import Figure, g, need
from pdcluster.planning.fleet import FleetSize, fleet_instances, fleet_needs
from pdcluster.planning.inputs import Accelerator, Deployment, ModelShape, Questions, Slos, Traffic
from pdcluster.planning.memory import memory_figures
from pdcluster.planning.speed import PrefillModel, StepModel, roofline_prefill, roofline_step

__all__ = ["Figure", "Plan", "PoolSize", "final_instances", "make_plan"]


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
    fleet: FleetSize | None = None  # from per-instance facts, when given

    def figure(self, key: str) -> Figure:
        for _, figures in self.sections:
            for f in figures:
                if f.key == key:
                    return f
        raise KeyError(key)

    def value(self, key: str) -> float:
        return self.figure(key).value


# --- speed ----------------------------------------------------------------


def recommended_batch(step: StepModel, slos: Slos, safe_concurrency: int, d: Deployment) -> Figure:
    within_slo = step.max_batch_within(slos.tpot_s)
    value = max(1, min(d.max_num_seqs, safe_concurrency, within_slo))
    return Figure("batch", "recommended decode batch B*", value, "requests",
                  f"max(1, min(max_num_seqs {d.max_num_seqs}, safe concurrency {safe_concurrency}, "
                  f"largest B with step(B) <= TPOT {g(slos.tpot_s)} s: {within_slo}))",
                  "max(1, min(max_num_seqs, safe concurrency, largest B with step(B) <= TPOT SLO))")


def decode_tok_s(step: StepModel, batch: int) -> Figure:
    step_s = step.step_s(batch)
    return Figure("decode_tok_s", "decode tok/s per instance at B*", batch / step_s, "tok/s",
                  f"B* {batch} / step({batch}) {g(step_s)} s   [{step.describe(batch)}]", "B* / step(B*)")


def bandwidth_bound_tok_s(a: Accelerator, weights: Figure) -> Figure:
    return Figure("decode_bound_tok_s", "decode ceiling, batch 1 (peak bandwidth)", a.bandwidth_bytes_s / weights.value, "tok/s",
                  f"bandwidth {g(a.bandwidth_bytes_s)} B/s / weights per device {g(weights.value)} B",
                  "bandwidth / weights per device")


def prefill_time(prefill: PrefillModel, tokens: float, key: str, label: str) -> Figure:
    return Figure(key, label, prefill.time_s(tokens), "s", prefill.describe(tokens), "prefill(n)")


def prefill_tok_s(prefill: PrefillModel, input_mean: float) -> Figure:
    """Compute throughput: the fixed per-request overhead (HTTP, routing, KV
    hand-off) adds latency but does not occupy the prefill instance."""
    t = prefill.time_s(input_mean) - prefill.overhead_s
    return Figure("prefill_tok_s", "prefill tok/s per instance (mean prompt)", input_mean / t, "tok/s",
                  f"input_mean {g(input_mean)} / (prefill({g(input_mean)}) - overhead {g(prefill.overhead_s)} s) = "
                  f"{g(input_mean)} / {g(t)} s", "input_mean / (prefill(input_mean) - overhead)")


# --- instances ------------------------------------------------------------


def final_instances(pool: str, needs: list[Figure], d: Deployment) -> tuple[PoolSize, Figure]:
    largest = max(f.value for f in needs)
    final = math.ceil(largest * d.redundancy - 1e-9)
    size = PoolSize(pool, *(int(f.value) for f in needs), final=final)
    return size, Figure(f"{pool}_instances", f"{pool} instances", final, "instances",
                        f"ceil(max({', '.join(g(f.value) for f in needs)}) x redundancy {g(d.redundancy)})",
                        "ceil(max(throughput, concurrency, KV) x redundancy)")


def prefill_needs(t: Traffic, d: Deployment, rate: Figure, prefill_mean: Figure, capacity: Figure,
                  cached_tokens: float = 0.0) -> list[Figure]:
    in_flight = t.peak_rps * prefill_mean.value
    little = f"L = rps {g(t.peak_rps)} x W {g(prefill_mean.value)} s"
    prompt = f"(input_mean {g(t.input_mean)} - cached {g(cached_tokens)})" if cached_tokens else f"input_mean {g(t.input_mean)}"
    return [
        need("prefill_by_throughput", "prefill by throughput", t.peak_rps * (t.input_mean - cached_tokens) / rate.value,
             f"rps {g(t.peak_rps)} x {prompt} / {g(rate.value)} tok/s", "rps x (input_mean - cached) / prefill tok/s"),
        need("prefill_by_concurrency", "prefill by concurrency (Little)", in_flight / d.max_num_seqs,
             f"{little} = {g(in_flight)} / max_num_seqs {d.max_num_seqs}", "rps x prefill(input_mean) / max_num_seqs"),
        need("prefill_by_kv", "prefill by KV", in_flight * t.input_mean / (capacity.value * d.safety),
             f"{little} x input_mean {g(t.input_mean)} / ({g(capacity.value)} tokens x safety {g(d.safety)})",
             "L x input_mean / (KV capacity x safety)"),
    ]


def decode_needs(t: Traffic, d: Deployment, tok_s: Figure, batch: Figure, step_s: float, capacity: Figure) -> list[Figure]:
    in_flight = t.peak_rps * t.output_mean * step_s
    little = f"L = rps {g(t.peak_rps)} x W (output_mean {g(t.output_mean)} x step {g(step_s)} s)"
    return [
        need("decode_by_throughput", "decode by throughput", t.peak_rps * t.output_mean / tok_s.value,
             f"rps {g(t.peak_rps)} x output_mean {g(t.output_mean)} / {g(tok_s.value)} tok/s", "rps x output_mean / decode tok/s"),
        need("decode_by_concurrency", "decode by concurrency (Little; = throughput)", in_flight / batch.value,
             f"{little} = {g(in_flight)} / B* {g(batch.value)}", "rps x output_mean x step(B*) / B*"),
        need("decode_by_kv", "decode by KV", in_flight * (t.input_mean + t.output_mean / 2) / (capacity.value * d.safety),
             f"{little} x (input_mean {g(t.input_mean)} + output_mean {g(t.output_mean)} / 2) / "
             f"({g(capacity.value)} tokens x safety {g(d.safety)})", "L x (input_mean + output_mean / 2) / (KV capacity x safety)"),
    ]


def cost_per_million(pool: str, instances: int, tokens_s: float, d: Deployment, what: str) -> Figure:
    return Figure(f"cost_per_m_{what}", f"cost per million {what} tokens (the plan's fleet)",
                  instances * d.price_per_instance_hour / (tokens_s * 3600) * 1e6, "$",
                  f"{pool} instances {instances} x ${g(d.price_per_instance_hour)}/h / ({g(tokens_s)} tok/s x 3600) x 1e6",
                  f"{pool} instances x $/h / (rps x {what}_mean x 3600) x 1e6")


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


def _speed(a: Accelerator, d: Deployment, s: Slos, t: Traffic, step: StepModel, prefill: PrefillModel,
           mem: dict[str, Figure]) -> list[Figure]:
    batch = recommended_batch(step, s, int(mem["safe_concurrency"].value), d)
    b = int(batch.value)
    return [
        bandwidth_bound_tok_s(a, mem["weights_per_device_bytes"]),
        Figure("step_s_batch1", "decode step, batch 1", step.step_s(1), "s", step.describe(1), "step(1)"),
        batch,
        Figure("step_s_batch", "decode step (TPOT) at B*", step.step_s(b), "s", step.describe(b), "step(B*)"),
        decode_tok_s(step, b),
        prefill_time(prefill, t.input_mean, "prefill_s_mean", "prefill time, mean prompt"),
        prefill_time(prefill, t.input_p95, "prefill_s_p95", "prefill time, p95 prompt"),
        prefill_tok_s(prefill, t.input_mean),
    ]


def _latency_and_demand(m: ModelShape, a: Accelerator, d: Deployment, t: Traffic, s: Slos, q: Questions,
                        sp: dict[str, Figure]) -> tuple[list[Figure], list[Figure]]:
    e2e_slo = fig.e2e_at_slos(t, s, q.queue_s)
    e2e_predicted = fig.e2e("e2e_s_predicted", "E2E predicted (prefill + decode at B*)", q.queue_s, sp["prefill_s_mean"].value,
                            t.output_mean, sp["step_s_batch"].value, "prefill(input_mean)", "step(B*)")
    dwell_s, dwell_source = (q.dwell_s, "--dwell-s") if q.dwell_s is not None else (e2e_slo.value, "E2E at the SLOs")
    demand = [*fig.token_demand(t), *fig.prefill_flops(m, a, d, t), fig.active_requests(t, dwell_s, dwell_source)]
    return [e2e_slo, e2e_predicted], demand


def _pools(t: Traffic, d: Deployment, cached: float, mem: dict[str, Figure], sp: dict[str, Figure]):
    rate, tok_s, capacity = sp["prefill_tok_s"], sp["decode_tok_s"], mem["kv_capacity_tokens"]
    p_needs = prefill_needs(t, d, rate, sp["prefill_s_mean"], capacity, cached)
    d_needs = decode_needs(t, d, tok_s, sp["batch"], sp["step_s_batch"].value, capacity)
    p_size, p_final = final_instances("prefill", p_needs, d)
    d_size, d_final = final_instances("decode", d_needs, d)
    p_busy, d_busy = t.peak_rps * (t.input_mean - cached) / rate.value, t.peak_rps * t.output_mean / tok_s.value
    figures = [*p_needs, p_final, *d_needs, d_final,
               Figure("prefill_decode_load_ratio", "prefill : decode busy instances", p_busy / d_busy, "",
                      f"{g(p_busy)} / {g(d_busy)}", "(prefill tok/s demand / prefill tok/s) / (output tok/s demand / decode tok/s)"),
               Figure("prefill_decode_ratio", "prefill : decode replicas", p_size.final / d_size.final, "",
                      f"{p_size.final} : {d_size.final}", "prefill instances : decode instances")]
    return figures, p_size, d_size


def _cost(t: Traffic, d: Deployment, q: Questions, p_size: PoolSize, d_size: PoolSize, tok_s: Figure) -> list[Figure]:
    capacity_tok_s, source = ((q.per_instance.tok_s, "--instance-tok-s") if q.per_instance.tok_s is not None
                              else (tok_s.value, "decode tok/s at B*"))
    return [
        cost_per_million("prefill", p_size.final, t.peak_rps * t.input_mean, d, "input"),
        cost_per_million("decode", d_size.final, t.peak_rps * t.output_mean, d, "output"),
        fig.cost_at_capacity(d, capacity_tok_s, source),
        Figure("cost_per_hour", "fleet cost per hour", (p_size.final + d_size.final) * d.price_per_instance_hour, "$",
               f"({p_size.final} + {d_size.final}) instances x ${g(d.price_per_instance_hour)}/h",
               "(prefill + decode instances) x $/h"),
    ]


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
    questions: Questions = Questions(),
) -> Plan:
    """The plan; ``step``/``prefill`` replace the roofline models with measured ones."""
    q = questions
    if q.prefix and q.prefix.shared_prefix_tokens > t.input_mean:
        raise ValueError(f"--shared-prefix-tokens {g(q.prefix.shared_prefix_tokens)} exceeds the mean prompt "
                         f"({g(t.input_mean)} tokens, --input-mean): a shared prefix is part of the prompt")
    memory = memory_figures(m, a, d, t, context_tokens, q.concurrency)
    mem = {f.key: f for f in memory}
    step = step or roofline_step(m, a, d, mem["weights_per_device_bytes"].value, mem["kv_bytes_per_token_device"].value,
                                 t.input_mean + t.output_mean / 2)
    prefill = prefill or roofline_prefill(m, a, d)
    speed = _speed(a, d, s, t, step, prefill, mem)
    sp = {f.key: f for f in speed}
    latency, demand = _latency_and_demand(m, a, d, t, s, q, sp)
    cached = q.prefix.shared_prefix_tokens * q.prefix.hit_rate if q.prefix else 0.0  # prompt tokens not prefilled
    instances, p_size, d_size = _pools(t, d, cached, mem, sp)
    sections = [("memory", memory), ("demand", demand), ("speed", speed), ("latency", latency), ("instances", instances)]

    fleet = None
    if q.per_instance.given:
        f_needs = fleet_needs(q.per_instance, demand[1], demand[-1], q.concurrency, mem["safe_concurrency"])
        fleet, f_final = fleet_instances(f_needs, d)
        sections.append(("instances from per-instance facts", [*f_needs, f_final]))
    if q.prefix:
        sections.append(("prefix cache", fig.prefix_cache(m, t, q.prefix)))
    spec = fig.speculation(q.spec, sp["step_s_batch1"].value) if q.spec else []
    if spec:
        sections.append(("speculative decoding", spec))
    if q.pipeline:
        sections.append(("pipeline", fig.pipeline_bubble(q.pipeline.stages, q.pipeline.micro_batches)))
    sections.append(("cost", _cost(t, d, q, p_size, d_size, sp["decode_tok_s"])))

    warnings = _checks(m, t, s, mem["context_tokens"].value, mem["safe_concurrency"], step, sp["prefill_s_p95"])
    speedup = next((f.value for f in spec if f.key == "spec_speedup"), 1.0)
    if speedup < 1:
        warnings.append(f"speculative decoding slows decoding at acceptance {g(q.spec.accept)} "
                        f"(speedup {speedup:.3g} < 1): raise --spec-accept or lower --spec-k")
    return Plan(sections, p_size, d_size, int(sp["batch"].value), sp["decode_tok_s"].value, warnings, fleet)
