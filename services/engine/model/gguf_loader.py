"""Reads a llama-architecture GGUF: config from metadata (services/model_meta.py), tensors dequantized
(F32/F16/BF16/Q8_0/Q4_0/Q4_1 and whatever else ``gguf`` dequantizes) and
renamed to Hugging Face names.

llama.cpp's converter permutes the rows of q/k weights so that RoPE rotates
adjacent pairs; our model rotates halves (the HF convention), so the rows are
permuted back here."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from services.engine.model.config import ModelConfig
from services.model_meta import read_gguf_config

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(name: str) -> str | None:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows (per head: pairs -> halves)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    cfg = read_gguf_config(reader)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        arr = gguf.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(arr, dtype=np.float32))
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, cfg.num_kv_heads)
        state[name] = w.to(dtype)
    return cfg, state
