"""Weights in 8 bits (``weight_dtype: int8``): every decoder projection as
per-output-channel symmetric int8 codes and fp32 scales
(kernels/int8_linear.quantize_weight), quantized from the checkpoint's own
values (fp32 for a GGUF's converted copy) before any cast to the model dtype.
Embeddings, norms and the LM head stay in the model dtype: the head is the
last step before sampling, and the tied embedding is the same matrix.

For a GGUF the quantized tensors are made once and kept beside the
converted copy (services/model_cache.py ``derived_file``), keyed by
``WEIGHT_SCHEMES``' file name; a Hugging Face directory is quantized at load
(a second or two at SmolLM2's size).  The scheme's id joins the block-hash
seed (services/model_meta.py), so KV computed under int8 weights never
meets KV computed under bf16 ones."""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.int8_linear import quantize_weight
from services.engine.model.config import ModelConfig
from services.engine.model.llama import PROJECTION_NAMES
from services.model_meta import WEIGHT_SCHEMES, is_gguf

# How each fused projection is made of checkpoint tensors (HF names under model.layers.{i}.)
_PARTS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "down_proj": ("mlp.down_proj",)}


def quantize_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``{layers.{i}.{proj}.wq: int8 [N, K], layers.{i}.{proj}.scale: fp32 [N]}`` from HF-named tensors."""
    out = {}
    for i in range(cfg.num_layers):
        for name in PROJECTION_NAMES:
            w = torch.cat([state[f"model.layers.{i}.{part}.weight"].float() for part in _PARTS[name]])
            wq, scale = quantize_weight(w)
            out[f"layers.{i}.{name}.wq"], out[f"layers.{i}.{name}.scale"] = wq.contiguous(), scale.contiguous()
    return out


def quantized_projections(path: Path, state: dict[str, torch.Tensor], cfg: ModelConfig,
                          scheme: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The projections of the model at ``path`` in ``scheme`` ("int8"), as
    ``LlamaModel.quantize_projections`` takes them; cached beside a GGUF's converted copy."""
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"weight scheme {scheme!r} is not one of {sorted(WEIGHT_SCHEMES)}")
    if is_gguf(path):
        from safetensors.torch import load_file, save_file

        from services.model_cache import derived_file

        def make(tmp: Path) -> None:
            save_file(quantize_state(state, cfg), str(tmp))

        flat = load_file(str(derived_file(path, f"weights-{WEIGHT_SCHEMES[scheme]}.safetensors", make)))
    else:
        flat = quantize_state(state, cfg)
    return {f"layers.{i}.{name}": (flat[f"layers.{i}.{name}.wq"], flat[f"layers.{i}.{name}.scale"])
            for i in range(cfg.num_layers) for name in PROJECTION_NAMES}
