"""Loads a model and its tokenizer from one source: a Hugging Face
safetensors directory or a GGUF file."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.model.config import ModelConfig
from services.engine.model.default import resolve_model_path
from services.engine.model.gguf_loader import load_gguf
from services.engine.model.llama import LlamaModel
from services.engine.tokenizer import Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    path: Path
    name: str
    weights_id: str  # identifies the weights (file name + size + mtime digest)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def weights_id(path: Path) -> str:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}".encode())
    return h.hexdigest()


def _load_safetensors_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; give a Hugging Face model directory or a .gguf file")
    cfg = ModelConfig.from_hf(json.loads(config_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
    return cfg, state


def load_model(model: str | None = None, dtype: str | torch.dtype = "bfloat16",
               device: str = "cpu") -> LoadedModel:
    path = resolve_model_path(model)
    torch_dtype = parse_dtype(dtype)
    if path.is_file() and path.suffix == ".gguf":
        cfg, state = load_gguf(path, torch_dtype)
    elif path.is_dir():
        cfg, state = _load_safetensors_dir(path, torch_dtype)
    else:
        raise ValueError(f"{path}: expected a .gguf file or a directory with config.json and *.safetensors")
    with torch.device("meta"):
        net = LlamaModel(cfg)
    net = net.to_empty(device=device).to(torch_dtype)
    net.reset_rope()  # fp32 caches, rebuilt after to_empty and the cast
    net.load_hf_state(state)
    net.eval().requires_grad_(False)
    tokenizer = Tokenizer.from_path(path, cfg)
    return LoadedModel(cfg, net, tokenizer, path, path.stem if path.is_file() else path.name, weights_id(path))


def block_hash_seed(weights: str, kv_dtype: torch.dtype, block_size: int) -> int:
    """The seed of every block-hash chain for these weights, KV dtype and
    block size: engine, gateway and index must agree on it."""
    from prefix_store.hashing import model_fingerprint

    return model_fingerprint(weights, kv_dtype, block_size)
