"""The planner's inputs: model shape, accelerator, deployment, traffic, SLOs,
with datasheet presets and a reader for a model's own files."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

GiB = 1024**3
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


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
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: float  # per device
    bandwidth_bytes_s: float  # per device
    flops: float  # dense bf16 FLOP/s per device


@dataclass(frozen=True)
class Deployment:
    tp: int = 1  # devices per instance (tensor parallel)
    weight_bytes: float = 2.0  # bytes per parameter (bf16)
    kv_bytes: float = 2.0  # bytes per KV element
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
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")
        if self.tp < 1 or self.block_size < 1 or self.redundancy < 1:
            raise ValueError("tp and block_size must be >= 1 and redundancy >= 1")


@dataclass(frozen=True)
class Traffic:
    peak_rps: float
    input_mean: float
    input_p95: float
    output_mean: float
    output_p95: float


@dataclass(frozen=True)
class Slos:
    ttft_s: float
    tpot_s: float


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


def _gguf_shape(path: Path) -> ModelShape:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field(key: str, default=None):
        return reader.fields[key].contents() if key in reader.fields else default

    arch = field("general.architecture")
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    return ModelShape(
        name=path.stem,
        params=float(sum(int(t.n_elements) for t in reader.tensors)),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv")),
        head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
        max_context=int(field(f"{arch}.context_length")),
    )


def _safetensors_params(directory: Path) -> float | None:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for dim in meta["shape"]:
                    count *= dim
                total += count
    return float(total)


def _hf_shape(directory: Path) -> ModelShape:
    config = json.loads((directory / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    params = _safetensors_params(directory)
    if params is None:
        raise ValueError(f"{directory} has no *.safetensors to count parameters: pass --params")
    return ModelShape(
        name=directory.name,
        params=params,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or hidden // heads),
        max_context=config.get("max_position_embeddings"),
    )


def read_model_shape(spec: str) -> ModelShape:
    """A preset name, a .gguf file, or a Hugging Face model directory."""
    if spec in MODEL_PRESETS:
        return MODEL_PRESETS[spec]
    path = Path(spec)
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_shape(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _hf_shape(path)
    raise FileNotFoundError(
        f"model {spec!r}: not a preset ({', '.join(MODEL_PRESETS)}), a .gguf file, or a directory with config.json"
    )
