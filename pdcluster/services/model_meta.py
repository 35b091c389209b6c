"""What a model is, read without its weights and without torch: its shape
(from an HF ``config.json``, or a GGUF's metadata through its converted copy,
pdcluster/services/model_cache.py), its parameter count, the id of
its weights and the seed of its block-hash chains.

The gateway, the CLI and `pdcluster plan` read models through here; the engine's
loader (pdcluster/services/engine/model/loader.py) reads the same config and seed from
here and adds the tensors.

The seed ties the router's, the index's and every engine's block hashes
together, so the gateway and each replica must compute the same one::

    block_hash_seed = model_fingerprint(weights_id, "torch.<kv pool dtype>[+K_SMOOTHING_ID+K_ROTATION_ID]"
                                        "[+weights:WEIGHT_SCHEMES[weight_dtype]]", block_size)

    weights_id       digest of the weights files' names and sizes
    kv pool dtype    kv_cache_dtype, or the model's dtype for "auto"
    K_SMOOTHING_ID   8-bit pools only: how their K rows are shifted before
                     quantizing (pdcluster/services/engine/model/k_smoothing.py), so
                     blocks shifted two ways never share a hash
    K_ROTATION_ID    8-bit pools only: how q and K are rotated before K is
                     quantized (pdcluster/kernels/kv_rotation.py), likewise
    WEIGHT_SCHEMES   weight_dtype other than auto only: how the weights were
                     quantized (pdcluster/services/engine/model/weight_quant.py), so KV
                     computed under int8 weights never mixes with bf16's

The dtype is spelled as torch prints it (``torch.bfloat16``): the engine
hashed ``str(torch_dtype)`` before this module existed, and a seed must not
change under a running index."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from pathlib import Path

from pdcluster.planning.inputs import MODEL_PRESETS, ModelShape, model_preset
from pdcluster.prefix_store.hashing import model_fingerprint
from pdcluster.services.engine.model.config import ModelConfig
from pdcluster.services.model_cache import cached_config, tensors_file

# config names of a model dtype -> torch's name of it
MODEL_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
                "float16": "float16", "fp16": "float16"}
# config names of a KV pool dtype -> torch's name ("auto": the model's); pdcluster/kernels/kv_quant.pool_dtype agrees
_KV_POOL_DTYPES = {"bf16": "bfloat16", "int8": "int8", "fp8_e4m3": "float8_e4m3fn"}
# 8-bit pools' K smoothing (pdcluster/services/engine/model/k_smoothing.py): bump the
# version whenever the derivation of its shift changes
K_SMOOTHING_ID = "k-smoothing-v1"
# 8-bit pools' K rotation (pdcluster/kernels/kv_rotation.py): bump whenever the rotation changes
K_ROTATION_ID = "k-hadamard-v1"
_SMOOTHED_POOL_DTYPES = ("int8", "float8_e4m3fn")
# weight_dtype -> the id of its quantization scheme (auto: the checkpoint in the model dtype, no id);
# bump the version whenever the quantization changes
WEIGHT_SCHEMES = {"int8": "int8-g32-fp16dm-head-v1"}
WEIGHT_DTYPES = ("auto", *WEIGHT_SCHEMES)


# ---- shape -----------------------------------------------------------------

def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def read_model_config(path: Path) -> ModelConfig:
    """The shape of the model at ``path``: a .gguf file or an HF directory."""
    if is_gguf(path):
        return cached_config(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; give a Hugging Face model directory or a .gguf file")
    return ModelConfig.from_hf(json.loads(config_file.read_text()))


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files holding the weights at ``path``: an HF
    directory's, or the one of a GGUF's converted copy."""
    return [tensors_file(path)] if is_gguf(path) else sorted(path.glob("*.safetensors"))


def count_parameters(path: Path) -> float | None:
    """Parameters stored at ``path`` (the safetensors headers of an HF
    directory, or of a GGUF's converted copy), counted without reading a
    weight; None: no weights files."""
    files = safetensors_files(path)
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



def read_model_shape(spec: str | None) -> ModelShape:
    """The planner's shape of a model (pdcluster/planning/inputs.py): a preset name, "default" (or nothing)
    for the bundled model, a .gguf file, or a Hugging Face model directory."""
    if (preset := model_preset(spec)) is not None:
        return preset
    path = Path(spec)
    if not ((path.suffix == ".gguf" and path.is_file()) or (path.is_dir() and (path / "config.json").is_file())):
        raise FileNotFoundError(f"--model {spec!r}: not 'default', a preset ({', '.join(MODEL_PRESETS)}), "
                                f"a .gguf file, or a directory with config.json")
    config = read_model_config(path)
    params = count_parameters(path)
    if params is None:
        raise ValueError(f"{path} has no *.safetensors to count parameters: pass --params")
    return ModelShape(name=path.stem if path.is_file() else path.name, params=params, num_layers=config.num_layers,
                      num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                      max_context=config.max_position_embeddings)

# ---- identity --------------------------------------------------------------

def weights_id(path: Path) -> str:
    """Identifies the weights at ``path`` by file names and sizes (not contents: cheap, and stable across copies)."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}".encode())
    return h.hexdigest()


def model_dtype_name(dtype: str) -> str:
    """torch's name of a configured model dtype ("bf16" -> "bfloat16")."""
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(MODEL_DTYPES)}")
    return MODEL_DTYPES[dtype]


def kv_pool_dtype_name(kv_cache_dtype: str, model_dtype: str) -> str:
    """torch's name of the KV pool's element dtype, as pdcluster/kernels/kv_quant.pool_dtype picks it."""
    if kv_cache_dtype == "auto":
        return model_dtype_name(model_dtype)
    if kv_cache_dtype not in _KV_POOL_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_KV_POOL_DTYPES)}, got {kv_cache_dtype!r}")
    return _KV_POOL_DTYPES[kv_cache_dtype]


def check_weight_dtype(weight_dtype: str) -> str:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    return weight_dtype


def block_hash_seed(weights: str, kv_dtype: object, block_size: int, weight_dtype: str = "auto") -> int:
    """The seed of every block-hash chain for these weights, KV pool dtype
    (a torch dtype, or its name), block size and weight scheme: engine,
    gateway and index must agree on it.  8-bit pools hold K rotated and
    shifted (K rotation, K smoothing), whose ids join the dtype; quantized
    weights add their scheme's id; plain pools of unquantized weights hash
    as before either existed."""
    name = str(kv_dtype).removeprefix("torch.")
    label = (f"torch.{name}+{K_SMOOTHING_ID}+{K_ROTATION_ID}" if name in _SMOOTHED_POOL_DTYPES
             else f"torch.{name}")
    if check_weight_dtype(weight_dtype) != "auto":
        label += f"+weights:{WEIGHT_SCHEMES[weight_dtype]}"
    return model_fingerprint(weights, label, block_size)


def model_hash_seed(path: Path, dtype: str, kv_cache_dtype: str, block_size: int, weight_dtype: str = "auto") -> int:
    """``block_hash_seed`` of the model at ``path`` served with these config values."""
    return block_hash_seed(weights_id(path), kv_pool_dtype_name(kv_cache_dtype, dtype), block_size, weight_dtype)


def seed_mismatches(expected_seed: int, statuses: Iterable[dict]) -> list[str]:
    """One line per replica whose status reports a block-hash seed other than
    ``expected_seed``; a status without ``hash_seed`` (not reported yet) passes."""
    return [f"replica {s.get('name', '?')} ({s.get('role', '?')}) hashes blocks with seed {s['hash_seed']:#018x}, "
            f"the gateway with {expected_seed:#018x}: they serve different weights, KV dtype or block size; "
            f"start every pool and the gateway from the same model and config"
            for s in statuses if s.get("hash_seed") is not None and s["hash_seed"] != expected_seed]
