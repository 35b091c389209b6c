"""Weights in 8 bits (``weight_dtype: int8``): every decoder projection, and
the LM head, as int8 codes with an fp16 scale d and offset m per (row, 32
consecutive inputs) (pdcluster/kernels/int8_linear.py); activations stay bf16.

    layers.{i}.{proj}.codes    int8 [N, K]        proj in PROJECTION_NAMES, fused as the model holds them
    layers.{i}.{proj}.scales   fp16 [N, K/32, 2]  (d, m) per group
    lm_head.codes, lm_head.scales                 the LM head's own copy (a tied embedding keeps its bf16 rows)

From a GGUF the groups are the file's own blocks (Q4_1: codes 0..15; Q8_0:
codes -127..127, m = 0), taken as they are: the same values as the file,
nearer to it than the bf16 copy the engine otherwise runs (that copy rounds
them to bf16).  A tensor of another type, and every tensor of a Hugging
Face directory, is quantized per group (``quantize_int8_weight``).  Norms,
biases and the embedding rows are not touched.

The LM head in int8: at batch 1 it streams 49152 x 576 weights, a fifth of
a bf16 step's bytes; int8 reads 1.125 bytes a weight instead of 2, and
measured 0.18x-0.58x of bf16's time at batch 1 across runs on a noisy
machine (bench.micro.weight_quant --kernels, the head's row;
pdcluster/kernels/int8_linear.py).

For a GGUF the tensors are made once and kept beside the converted copy
(pdcluster/services/model_cache.py ``derived_file``), named by the scheme's id
(pdcluster/services/model_meta.py WEIGHT_SCHEMES); a Hugging Face directory is
quantized at load (seconds at SmolLM2's size).  The id joins the block-hash
seed, so KV computed under int8 weights never meets bf16's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pdcluster.kernels.ops import int8_weight_from_gguf, quantize_int8_weight
from pdcluster.services.engine.model.config import ModelConfig
from pdcluster.services.engine.model.llama import PROJECTION_NAMES
from pdcluster.services.model_meta import WEIGHT_SCHEMES, is_gguf

# How each fused projection is made of checkpoint tensors (HF names under model.layers.{i}.)
_PARTS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "down_proj": ("mlp.down_proj",)}

Groups = tuple[torch.Tensor, torch.Tensor]  # (codes int8 [N, K], scales fp16 [N, K/32, 2])


def quantize_state(groups_of: Callable[[str], Groups], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors drawn in the module docstring; ``groups_of(hf_name)``: one checkpoint weight in groups."""
    out = {}
    for i in range(cfg.num_layers):
        for name in PROJECTION_NAMES:
            parts = [groups_of(f"model.layers.{i}.{part}.weight") for part in _PARTS[name]]
            out[f"layers.{i}.{name}.codes"] = torch.cat([c for c, _ in parts]).contiguous()
            out[f"layers.{i}.{name}.scales"] = torch.cat([s for _, s in parts]).contiguous()
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    out["lm_head.codes"], out["lm_head.scales"] = (t.contiguous() for t in groups_of(head))
    return out


def gguf_groups(path: Path, cfg: ModelConfig) -> dict[str, Groups]:
    """Every weight the scheme quantizes, under its Hugging Face name, from the GGUF at ``path``: Q4_1 and
    Q8_0 blocks as they are, other types quantized from their values; q/k rows put in our order."""
    import gguf
    import numpy as np

    from pdcluster.services.engine.model.gguf_format import hf_name, unpermute

    wanted = {f"model.layers.{i}.{part}.weight" for i in range(cfg.num_layers) for parts in _PARTS.values()
              for part in parts}
    wanted |= {"model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"}
    found = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        name = hf_name(t.name)
        if name not in wanted:
            continue
        kind = int(t.tensor_type)
        if kind in (int(gguf.GGMLQuantizationType.Q4_1), int(gguf.GGMLQuantizationType.Q8_0)):
            codes, scales = int8_weight_from_gguf(np.asarray(t.data), kind)
        else:
            codes, scales = quantize_int8_weight(torch.from_numpy(
                np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)))
        heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            codes = torch.from_numpy(np.ascontiguousarray(unpermute(codes.numpy(), heads)))
            scales = torch.from_numpy(np.ascontiguousarray(unpermute(scales.numpy(), heads)))
        found[name] = (codes, scales)
    return found


def quantized_weights(path: Path, state: dict[str, torch.Tensor], cfg: ModelConfig,
                      scheme: str) -> dict[str, torch.Tensor]:
    """The model at ``path`` in ``scheme`` ("int8"), as ``LlamaModel.quantize_projections`` takes it;
    ``state``: its tensors under Hugging Face names (quantized from when it is not a GGUF)."""
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"weight scheme {scheme!r} is not one of {sorted(WEIGHT_SCHEMES)}")
    if not is_gguf(path):
        return quantize_state(lambda name: quantize_int8_weight(state[name]), cfg)
    from safetensors.torch import load_file, save_file

    from pdcluster.services.model_cache import derived_file

    def make(tmp: Path) -> None:
        save_file(quantize_state(gguf_groups(path, cfg).__getitem__, cfg), str(tmp))

    return load_file(str(derived_file(path, f"weights-{WEIGHT_SCHEMES[scheme]}.safetensors", make)))
