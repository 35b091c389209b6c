"""Loads a model and its tokenizer from one source: a Hugging Face
safetensors directory or a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdcluster.services.engine.model.config import ModelConfig
from pdcluster.services.default_model import resolve_model_path
from pdcluster.services.engine.model.llama import LlamaModel
from pdcluster.services.tokenizer import Tokenizer
from pdcluster.services.model_meta import (block_hash_seed, check_weight_dtype, is_gguf, model_dtype_name, read_model_config,
                                 safetensors_files, weights_id)

__all__ = ["LoadedModel", "block_hash_seed", "load_model", "parse_dtype", "weights_id"]


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    path: Path
    name: str
    weights_id: str  # identifies the weights (pdcluster/services/model_meta.weights_id)
    weight_dtype: str = "auto"  # "auto" (the model dtype) or a quantized scheme ("int8": weight_quant.py)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, model_dtype_name(dtype))


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor at ``path`` (an HF directory's safetensors files, or a
    GGUF's converted copy: pdcluster/services/model_cache.py) as stored: the model's
    ``copy_`` casts each once, into its parameter."""
    from safetensors.torch import load_file

    files = safetensors_files(path)
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _materialize(net: torch.nn.Module, dtype: torch.dtype, device: str) -> None:
    """Gives every meta parameter and buffer of ``net`` uninitialised storage on
    ``device``, floating ones in ``dtype`` (what ``.to(dtype).to_empty(device)``
    does, without its meta-tensor dispatch: that imports torch.fx's symbolic
    shapes and sympy, about 0.3 s of CPU in every replica, for tensors the
    loader overwrites next)."""
    for module in net.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in list(slots.items()):
                if t is None or t.device.type != "meta":
                    continue
                real = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                slots[name] = torch.nn.Parameter(real, requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else real


def load_model(model: str | None = None, dtype: str | torch.dtype = "bfloat16",
               device: str = "cpu", weight_dtype: str = "auto") -> LoadedModel:
    """``weight_dtype`` "int8": the decoder projections in int8 (pdcluster/services/engine/model/weight_quant.py);
    needs a bf16 model (the int8 kernels take bf16 activations)."""
    path = resolve_model_path(model)
    torch_dtype = parse_dtype(dtype)
    check_weight_dtype(weight_dtype)
    if weight_dtype != "auto" and torch_dtype is not torch.bfloat16:
        raise ValueError(f"weight_dtype {weight_dtype} runs with dtype bfloat16 (got {torch_dtype}): "
                         f"set dtype: bfloat16, or weight_dtype: auto")
    if not (is_gguf(path) or path.is_dir()):
        raise ValueError(f"{path}: expected a .gguf file or a directory with config.json and *.safetensors")
    cfg = read_model_config(path)
    state = _load_tensors(path)
    with torch.device("meta"):
        net = LlamaModel(cfg)
    _materialize(net, torch_dtype, device)
    net.reset_rope()  # fp32 caches, built once the weights are real
    net.load_hf_state(state)
    net.eval().requires_grad_(False)
    tokenizer = Tokenizer.from_path(path, cfg)
    if weight_dtype != "auto":
        from pdcluster.services.engine.model.weight_quant import quantized_weights
        net.quantize_projections(quantized_weights(path, state, cfg, weight_dtype), weight_dtype)
    return LoadedModel(cfg, net, tokenizer, path, path.stem if path.is_file() else path.name, weights_id(path),
                       weight_dtype)
