"""How much fits on an instance: weights, KV per token, the KV budget and
the concurrency it allows.  Per device of an instance (TP devices):

    weights/device      = params x weight_bytes / tp
    KV bytes/token      = 2 (K,V) x layers x kv_heads x row   (MHA: kv_heads = heads)
    KV bytes/token/dev  = 2 x layers x ceil(kv_heads / tp) x row
    row                 = head_dim x kv_bytes + scale_bytes     (scale_bytes: 2 for 8-bit KV, 0 else)

An 8-bit KV row carries its own scale (pdcluster/kernels/kv_quant.py), so int8/fp8 KV
is 1 + 2 / head_dim bytes per element, not 1: x0.516 of bf16 at head_dim 64.
    KV budget/device    = memory x (1 - reserve_fraction) - reserve_bytes - weights/device
    KV capacity         = floor(KV budget/device / KV bytes/token/dev)        tokens per instance
    max concurrency     = floor(KV capacity / (ceil(context / block) x block))   (< 1: an error, nothing fits)
    safe concurrency    = floor(max concurrency x safety)

A request holds whole blocks, so its context is rounded up to the block:

    |<------------- ceil(context / block) x block ------------->|
    | block | block | ... | block | last block, partly used     |
"""

from __future__ import annotations

import math

from pdcluster.planning.figures import Figure, g, kv_for_concurrency, kv_per_request
from pdcluster.planning.inputs import Accelerator, Deployment, ModelShape, Traffic


def weights_per_device(m: ModelShape, d: Deployment) -> Figure:
    return Figure("weights_per_device_bytes", "weights per device", m.params * d.weight_bytes / d.tp, "B",
                  f"params {g(m.params)} x {g(d.weight_bytes)} B / tp {d.tp}", "params x weight_bytes / tp")


def _row(m: ModelShape, d: Deployment) -> tuple[str, str]:
    """One (token, KV head) row's bytes: the formula with numbers, and in words."""
    if not d.kv_scale_bytes:
        return f"head_dim {m.head_dim} x {g(d.kv_bytes)} B", "head_dim x kv_bytes"
    return (f"(head_dim {m.head_dim} x {g(d.kv_bytes)} B + scale {g(d.kv_scale_bytes)} B)",
            "(head_dim x kv_bytes + scale_bytes)")


def kv_bytes_per_token(m: ModelShape, d: Deployment, kv_heads: int | None = None, key: str = "kv_bytes_per_token") -> Figure:
    heads = m.num_kv_heads if kv_heads is None else kv_heads
    value = 2 * m.num_layers * heads * d.kv_row_bytes(m.head_dim)
    label = "KV bytes per token (instance)" if kv_heads is None else "KV bytes per token if MHA"
    name = "kv_heads" if kv_heads is None else "heads"
    row, row_words = _row(m, d)
    return Figure(key, label, value, "B", f"2 x layers {m.num_layers} x {name} {heads} x {row}",
                  f"2 x layers x {name} x {row_words}")


def kv_bytes_per_token_device(m: ModelShape, d: Deployment) -> Figure:
    heads = math.ceil(m.num_kv_heads / d.tp)
    value = 2 * m.num_layers * heads * d.kv_row_bytes(m.head_dim)
    row, row_words = _row(m, d)
    return Figure("kv_bytes_per_token_device", "KV bytes per token per device", value, "B",
                  f"2 x layers {m.num_layers} x ceil(kv_heads {m.num_kv_heads} / tp {d.tp}) x {row}",
                  f"2 x layers x ceil(kv_heads / tp) x {row_words}")


def kv_budget_per_device(a: Accelerator, d: Deployment, weights: Figure) -> Figure:
    value = a.memory_bytes * (1 - d.reserve_fraction) - d.reserve_bytes - weights.value
    formula = (f"memory {g(a.memory_bytes)} B x (1 - reserve {g(d.reserve_fraction)}) - reserve {g(d.reserve_bytes)} B"
               f" - weights {g(weights.value)} B")
    if value <= 0:
        raise ValueError(f"no memory left for KV on {a.name}: {formula} = {g(value)} B; "
                         f"raise --tp, use a smaller --weight-dtype, or lower --reserve-fraction/--reserve-gib")
    return Figure("kv_budget_per_device_bytes", "KV budget per device", value, "B", formula,
                  "memory x (1 - reserve_fraction) - reserve_bytes - weights/device")


def kv_capacity_tokens(budget: Figure, kv_dev: Figure) -> Figure:
    return Figure("kv_capacity_tokens", "KV capacity per instance", math.floor(budget.value / kv_dev.value), "tokens",
                  f"floor({g(budget.value)} B / {g(kv_dev.value)} B per token)", "floor(KV budget/device / KV bytes/token/device)")


def max_concurrency(capacity: Figure, context: Figure, d: Deployment) -> tuple[Figure, Figure]:
    reserved = math.ceil(context.value / d.block_size) * d.block_size  # a request holds whole blocks
    theoretical = math.floor(capacity.value / reserved)
    if theoretical < 1:
        raise ValueError(f"no request fits: one request of {g(context.value)} tokens ({context.formula}) needs {g(reserved)} "
                         f"tokens of KV but an instance holds {g(capacity.value)}; shorten the context, raise --tp, "
                         f"use a smaller --kv-dtype, or a device with more memory")
    safe = math.floor(theoretical * d.safety)
    return (
        Figure("max_concurrency", "theoretical max concurrency", theoretical, "requests",
               f"floor({g(capacity.value)} tokens / (ceil({g(context.value)} / block {d.block_size}) x {d.block_size}))",
               "floor(KV capacity / (ceil(context / block) x block))"),
        Figure("safe_concurrency", "safe max concurrency", safe, "requests",
               f"floor({theoretical} x safety {g(d.safety)})", "floor(max concurrency x safety)"),
    )


def context_per_request(t: Traffic, context_tokens: float | None) -> Figure:
    if context_tokens is not None:
        return Figure("context_tokens", "context per request", context_tokens, "tokens", f"--context {g(context_tokens)}", "--context")
    return Figure("context_tokens", "context per request", t.input_p95 + t.output_p95, "tokens",
                  f"input_p95 {g(t.input_p95)} + output_p95 {g(t.output_p95)}", "input_p95 + output_p95")


def memory_figures(m: ModelShape, a: Accelerator, d: Deployment, t: Traffic, context_tokens: float | None,
                   concurrency: int | None) -> list[Figure]:
    """The memory section, in print order."""
    weights = weights_per_device(m, d)
    kv_tok = kv_bytes_per_token(m, d)
    kv_mha = kv_bytes_per_token(m, d, kv_heads=m.num_heads, key="kv_bytes_per_token_mha")
    kv_dev = kv_bytes_per_token_device(m, d)
    budget = kv_budget_per_device(a, d, weights)
    capacity = kv_capacity_tokens(budget, kv_dev)
    context = context_per_request(t, context_tokens)
    per_request = kv_per_request(kv_tok, context.value)
    gqa = Figure("gqa_saving", "KV saving of GQA over MHA", kv_mha.value / kv_tok.value, "x",
                 f"heads {m.num_heads} / kv_heads {m.num_kv_heads}", "heads / kv_heads")
    for_n = [kv_for_concurrency(per_request, concurrency)] if concurrency is not None else []
    return [weights, kv_tok, kv_mha, gqa, kv_dev, budget, capacity, context, per_request, *for_n,
            *max_concurrency(capacity, context, d)]
