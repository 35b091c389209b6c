"""Weights in 8 bits (``weight_dtype: int8``): every decoder projection as
per-output-channel symmetric int8 codes and fp32 scales
(pdcluster/kernels/int8_linear.quantize_weight), after activation smoothing
(pdcluster/services/engine/model/weight_smoothing.py: the per-token int8 activations
lose little), quantized from the checkpoint's own values (fp32 for a GGUF's
converted copy).  The LM head too, in its own int8 copy (measured: bf16 it
was a fifth of a batch-1 step's bytes; bench.micro.weight_quant reports the
quality); the embedding rows and the norms stay in the model dtype, the
norms holding the smoothing's division.

    layers.{i}.{proj}.wq      int8 [N, K]    proj in PROJECTION_NAMES, fused as the model holds them
    layers.{i}.{proj}.scale   fp32 [N]
    layers.{i}.input_layernorm, layers.{i}.post_attention_layernorm   fp32 [hidden], smoothed
    layers.{i}.qkv_bias       fp32 [N]       models with attention bias only, smoothed
    lm_head.wq, lm_head.scale the LM head's own int8 copy (the tied embedding keeps its bf16 rows)
    norm                      fp32 [hidden], the final norm, smoothed

For a GGUF the tensors are made once and kept beside the converted copy
(pdcluster/services/model_cache.py ``derived_file``), named by the scheme's id
(pdcluster/services/model_meta.py WEIGHT_SCHEMES); a Hugging Face directory is
quantized at load (seconds at SmolLM2's size).  The id joins the
block-hash seed, so KV computed under int8 weights never meets bf16's."""

from __future__ import annotations

from pathlib import Path

import torch

from pdcluster.kernels.ops import quantize_weight
from pdcluster.services.engine.model.config import ModelConfig
from pdcluster.services.engine.model.llama import PROJECTION_NAMES, LlamaModel
from pdcluster.services.engine.model.weight_smoothing import factors, input_maxima, smooth_layer
from pdcluster.services.model_meta import WEIGHT_SCHEMES, is_gguf

# How each fused projection is made of checkpoint tensors (HF names under model.layers.{i}.)
_PARTS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "down_proj": ("mlp.down_proj",)}


def _layer(state: dict[str, torch.Tensor], i: int, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}."
    w = {name: torch.cat([state[f"{p}{part}.weight"].float() for part in _PARTS[name]]) for name in PROJECTION_NAMES}
    w["input_layernorm"] = state[p + "input_layernorm.weight"].float()
    w["post_attention_layernorm"] = state[p + "post_attention_layernorm.weight"].float()
    if cfg.attention_bias:
        w["qkv_bias"] = torch.cat([state[f"{p}self_attn.{n}_proj.bias"].float() for n in "qkv"])
    return w


def quantize_state(state: dict[str, torch.Tensor], cfg: ModelConfig,
                   maxima: list[dict[str, torch.Tensor]] | None) -> dict[str, torch.Tensor]:
    """The tensors drawn in the module docstring, from HF-named ones; ``maxima``
    (weight_smoothing.input_maxima) smooths first, None does not."""
    out = {}
    for i in range(cfg.num_layers):
        w = _layer(state, i, cfg)
        if maxima is not None:
            w = smooth_layer(w, maxima[i], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        for name in PROJECTION_NAMES:
            wq, scale = quantize_weight(w.pop(name))
            out[f"layers.{i}.{name}.wq"], out[f"layers.{i}.{name}.scale"] = wq.contiguous(), scale.contiguous()
        out.update({f"layers.{i}.{k}": v.contiguous() for k, v in w.items()})
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"]).float()
    norm = state["model.norm.weight"].float()
    if maxima is not None:
        s = factors(maxima[cfg.num_layers]["lm_head"], head)
        head, norm = (head.double() * s).float(), (norm.double() / s).float()
    out["lm_head.wq"], out["lm_head.scale"] = (t.contiguous() for t in quantize_weight(head))
    out["norm"] = norm.contiguous()
    return out


def quantized_weights(path: Path, state: dict[str, torch.Tensor], model: LlamaModel, calibration_ids: list[int],
                      scheme: str) -> dict[str, torch.Tensor]:
    """The model at ``path`` in ``scheme`` ("int8"), as ``LlamaModel.quantize_projections`` takes it;
    ``model`` (loaded in bf16, unpacked) and ``calibration_ids`` give the smoothing's maxima."""
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"weight scheme {scheme!r} is not one of {sorted(WEIGHT_SCHEMES)}")
    make_state = lambda: quantize_state(state, model.cfg, input_maxima(model, calibration_ids))  # noqa: E731
    if not is_gguf(path):
        return make_state()
    from safetensors.torch import load_file, save_file

    from pdcluster.services.model_cache import derived_file

    def make(tmp: Path) -> None:
        save_file(make_state(), str(tmp))

    return load_file(str(derived_file(path, f"weights-{WEIGHT_SCHEMES[scheme]}.safetensors", make)))
