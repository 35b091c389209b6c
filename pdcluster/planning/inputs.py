"""The planner's inputs: model shape, accelerator, deployment, traffic, SLOs
and the optional questions (prefix cache, speculation, pipeline, per-instance
facts), with datasheet presets.  A model's own files are read by
pdcluster/services/model_meta.py (``read_model_shape``), which builds a
ModelShape: the planner never opens a model.

Every input type checks its own values and raises ``ValueError`` naming the
`pdcluster plan` flag that sets it, so a bad plan never gets as far as the
arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 1024**3  # memory sizes as runtimes report them
GB = 1e9  # bandwidths and datasheet sizes are decimal
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
# Bytes of scale per (token, KV head) row of an 8-bit KV cache: the engine keeps a
# per-token-per-head scale beside each row's head_dim payload bytes
# (pdcluster.kernels.kv_quant.SCALE_BYTES; a test pins the two together, the planner never imports torch).
KV_SCALE_BYTES = {"fp8": 2, "int8": 2}


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float  # parameter count
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # == num_heads for MHA, fewer for GQA
    head_dim: int
    max_context: int | None = None

    def __post_init__(self) -> None:
        _positive(self.params, "--params")
        for value, flag in ((self.num_layers, "--layers"), (self.num_heads, "--heads"),
                            (self.num_kv_heads, "--kv-heads"), (self.head_dim, "--head-dim")):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} query heads (--heads) are not a multiple of "
                             f"{self.num_kv_heads} KV heads (--kv-heads)")



def tp_problem(shape: ModelShape, tp: int) -> str | None:
    """Why ``tp`` devices cannot split this model's attention, or None.  Each device holds whole query
    heads, and whole KV heads: either a share of them (tp divides the KV heads) or, with more devices
    than KV heads, one KV head copied on tp / kv_heads devices (tp a multiple of the KV heads)."""
    if shape.num_heads % tp:
        return (f"--tp {tp} does not divide the {shape.num_heads} query heads of {shape.name}: "
                f"use a divisor of {shape.num_heads}")
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        return (f"--tp {tp} neither divides the {shape.num_kv_heads} KV heads of {shape.name} nor is a multiple of "
                f"them: use a divisor or a multiple of {shape.num_kv_heads}")
    return None

@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: float  # per device
    bandwidth_bytes_s: float  # per device
    flops: float  # dense bf16 FLOP/s per device

    def __post_init__(self) -> None:
        _positive(self.memory_bytes, "--memory-gib/--memory-gb")
        _positive(self.bandwidth_bytes_s, "--bandwidth-gbs")
        _positive(self.flops, "--tflops")


@dataclass(frozen=True)
class Deployment:
    tp: int = 1  # devices per instance (tensor parallel)
    weight_bytes: float = 2.0  # bytes per parameter (bf16)
    kv_bytes: float = 2.0  # bytes per KV element (payload)
    kv_scale_bytes: float = 0.0  # bytes of scale per (token, KV head) row: 8-bit KV (KV_SCALE_BYTES)
    reserve_fraction: float = 0.10  # of device memory kept for activations, runtime
    reserve_bytes: float = 0.0  # and this much more, absolute
    block_size: int = 16  # KV block, tokens
    safety: float = 0.9  # plan for this fraction of the theoretical max concurrency
    mbu: float = 0.8  # achieved / peak memory bandwidth (roofline only)
    mfu: float = 0.5  # achieved / peak FLOP/s (roofline only)
    max_num_seqs: int = 256  # scheduler limit on a running batch
    redundancy: float = 1.0  # multiply the required instances (N+1, zones, ...)
    price_per_instance_hour: float = 0.0

    def __post_init__(self) -> None:
        for name in ("safety", "mbu", "mfu"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"--{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"--reserve-fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.reserve_bytes < 0 or self.price_per_instance_hour < 0:
            raise ValueError("--reserve-gib and --price-per-hour must be >= 0")
        if self.tp < 1 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("--tp, --block-size and --max-num-seqs must be >= 1")
        if not self.redundancy >= 1:
            raise ValueError(f"--redundancy must be >= 1, got {self.redundancy}")
        _positive(self.weight_bytes, "--weight-dtype")
        _positive(self.kv_bytes, "--kv-dtype")
        if self.kv_scale_bytes < 0:
            raise ValueError(f"KV scale bytes per row must be >= 0, got {self.kv_scale_bytes}")

    def kv_row_bytes(self, head_dim: int) -> float:
        """Bytes of one (token, KV head) row: payload plus its scale."""
        return head_dim * self.kv_bytes + self.kv_scale_bytes


@dataclass(frozen=True)
class Traffic:
    peak_rps: float
    input_mean: float  # tokens per prompt (system + user)
    input_p95: float
    output_mean: float  # tokens generated per request
    output_p95: float

    def __post_init__(self) -> None:
        _positive(self.peak_rps, "--rps")
        for value, flag in ((self.input_mean, "--input-mean"), (self.input_p95, "--input-p95"),
                            (self.output_mean, "--output-mean"), (self.output_p95, "--output-p95")):
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"{flag} must be >= 1 token, got {value}")


@dataclass(frozen=True)
class Slos:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        _positive(self.ttft_s, "--ttft")
        _positive(self.tpot_s, "--tpot")


# --- the optional questions -------------------------------------------------


@dataclass(frozen=True)
class PrefixCache:
    shared_prefix_tokens: float  # tokens of a prompt shared with earlier ones (system prompt, few-shot)
    hit_rate: float  # fraction of requests whose shared prefix is found cached

    def __post_init__(self) -> None:
        if not (math.isfinite(self.shared_prefix_tokens) and self.shared_prefix_tokens >= 0):
            raise ValueError(f"--shared-prefix-tokens must be >= 0, got {self.shared_prefix_tokens}")
        if not 0 <= self.hit_rate <= 1:
            raise ValueError(f"--prefix-hit-rate must be in [0, 1], got {self.hit_rate}")


@dataclass(frozen=True)
class Speculation:
    k: int  # draft tokens proposed per verification step
    accept: float  # probability the target accepts one draft token (i.i.d.)
    cost: float  # one draft token's cost relative to one target forward pass

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"--spec-k must be >= 1, got {self.k}")
        if not 0 <= self.accept <= 1:
            raise ValueError(f"--spec-accept must be in [0, 1], got {self.accept}")
        if not 0 < self.cost <= 1:
            raise ValueError(f"--spec-cost must be in (0, 1], got {self.cost}")


@dataclass(frozen=True)
class Pipeline:
    stages: int  # s, pipeline-parallel stages
    micro_batches: int  # m, micro-batches per batch (GPipe)

    def __post_init__(self) -> None:
        if self.stages < 1 or self.micro_batches < 1:
            raise ValueError("--pp and --micro-batches must be >= 1")


@dataclass(frozen=True)
class PerInstance:
    """What a user measured on one running instance; ``None`` where not measured."""

    tok_s: float | None = None  # output tok/s one instance sustains
    active: float | None = None  # requests one instance holds in flight within the SLOs
    kv_safe: float | None = None  # requests whose KV one instance holds safely

    def __post_init__(self) -> None:
        for value, flag in ((self.tok_s, "--instance-tok-s"), (self.active, "--active-per-instance"),
                            (self.kv_safe, "--kv-safe-per-instance")):
            if value is not None:
                _positive(value, flag)

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.tok_s, self.active, self.kv_safe))


@dataclass(frozen=True)
class Questions:
    """Inputs of the figures beyond the core sizing; the defaults ask nothing extra."""

    concurrency: int | None = None  # N requests in flight at once, if the user knows it
    queue_s: float = 0.0  # mean queueing delay before prefill starts
    dwell_s: float | None = None  # measured time a request stays in an instance (else E2E at the SLOs)
    prefix: PrefixCache | None = None
    spec: Speculation | None = None
    pipeline: Pipeline | None = None
    per_instance: PerInstance = PerInstance()

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not (math.isfinite(self.queue_s) and self.queue_s >= 0):
            raise ValueError(f"--queue-s must be >= 0, got {self.queue_s}")
        if self.dwell_s is not None:
            _positive(self.dwell_s, "--dwell-s")


def _positive(value: float, flag: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be a finite number > 0, got {value}")


MODEL_PRESETS = {
    m.name: m
    for m in (
        ModelShape("smollm2-135m", 134_515_008, 30, 9, 3, 64, 8192),
        ModelShape("llama-3.1-8b", 8.03e9, 32, 32, 8, 128, 131072),
        ModelShape("llama-3.1-70b", 70.6e9, 80, 64, 8, 128, 131072),
        ModelShape("qwen2.5-7b", 7.62e9, 28, 28, 4, 128, 32768),
        ModelShape("mistral-7b", 7.24e9, 32, 32, 8, 128, 32768),
    )
}

# Datasheet peaks: dense bf16 FLOP/s, HBM bandwidth; memory as the runtime sees it.
ACCELERATOR_PRESETS = {
    a.name: a
    for a in (
        Accelerator("h100-sxm", 80 * GiB, 3.35e12, 989e12),
        Accelerator("h200", 140 * GiB, 4.8e12, 989e12),
        Accelerator("a100-80gb", 80 * GiB, 2.039e12, 312e12),
        Accelerator("l4", 22.5 * GiB, 300e9, 121e12),
        # this repository's 2-core Sapphire Rapids box (NOTES.md): AMX bf16
        # ~1.1 TFLOP/s per thread, streaming reads ~15 GB/s; a 16 GiB budget.
        Accelerator("cpu-2core", 16 * GiB, 15e9, 2.2e12),
    )
}


# The bundled default model (pdcluster/services/default_model.py ships its GGUF):
# SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads, head_dim 64,
# vocab 49,152, tied embeddings -> 49,152 x 576 + 30 x 3,540,096 + 576 params.
DEFAULT_MODEL_ALIASES = ("default", "SmolLM2-135M-Instruct")
DEFAULT_MODEL_PRESET = "smollm2-135m"


def model_preset(spec: str | None) -> ModelShape | None:
    """The preset ``spec`` names: "default" (or nothing) for the bundled model, or a preset's name; None
    for anything else (a model's files: pdcluster/services/model_meta.py read_model_shape)."""
    if spec is None or spec in DEFAULT_MODEL_ALIASES:
        return MODEL_PRESETS[DEFAULT_MODEL_PRESET]
    return MODEL_PRESETS.get(spec)
