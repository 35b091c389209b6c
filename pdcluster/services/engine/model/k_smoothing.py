"""K smoothing of an 8-bit KV pool: the shift ``b`` [layers, kv_heads,
head_dim] subtracted from post-RoPE K before it is quantized
(pdcluster/kernels/kv_quant.py says why no add-back is needed: every key a query sees
carries the same shift, so softmax over keys is unchanged).

Why: a few K channels carry a large offset shared by every token (SmolLM2:
per-channel max 3-6x the median), and one scale per row must cover them, so
the other channels keep few int8 steps.  Centering each channel removes the
offset from every row's range.

``b`` is a pure function of the weights, identical on every replica:

    tokens  CALIBRATION_CHAT through the model's chat template (built in;
            never a benchmark's prompts)
    K       one causal prefill of those tokens in float64, on the weights
            rounded to bf16 (a bf16 and an fp32 load of one checkpoint get
            the same b; float64 leaves summation order ~1e-16 to move)
    b       per (layer, kv head, channel): mean of post-RoPE K over the
            tokens after the first (the first is the attention sink, an
            outlier of its own), rounded to bf16 and held as fp32

Measured (bench/micro/levers_kv.py, fp32 weights, 16 chat prompts x 64
greedy tokens, int8 KV vs bf16 KV; 2-core AMD EPYC, avx2): 3 identical
without smoothing, 7 with it (fp8_e4m3: 3 and 4); 8 (fp8_e4m3: 4) once
prompt chunks attended to their own K/V (pdcluster/kernels/prefill_attention.py); 7
measured again at 91b6f89, 12 with K rotation on top (pdcluster/kernels/kv_rotation.py:
the pool then carries H b, the model rotates this b).  The calibration costs 1.0 s there (10.9 s
while the machine ran at load ~9); a proxy on held-out chats (mean int8
error of a K row relative to its norm: none 1.1 %, mean 0.41 %, median
0.42 %, midrange 0.43 %) picked the mean.

Its identity is part of the block-hash seed (pdcluster/services/model_meta.py
K_SMOOTHING_ID): change how ``b`` is derived and that id must change with it,
so blocks shifted two ways never meet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pdcluster.kernels import ops
from pdcluster.services.engine.model.llama import LlamaModel

# A conversation unlike any benchmark prompt: prose, times and numbers, code.
CALIBRATION_CHAT = (
    {"role": "user", "content": "My train leaves Lyon at 07:42 and is 25 minutes late. Can I catch a 12:30 bus "
                                "if the trip takes 4 h 16 min?"},
    {"role": "assistant", "content": "You arrive at 12:23, which leaves 7 minutes: tight but possible."},
    {"role": "user", "content": "Now count the vowels in a string, in code."},
    {"role": "assistant", "content": "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)"},
)


def calibration_token_ids(tokenizer) -> list[int]:
    """The built-in calibration sequence, through ``tokenizer``'s chat template."""
    return list(tokenizer.apply_chat_template(list(CALIBRATION_CHAT)))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _w(t: torch.Tensor) -> torch.Tensor:
    """A weight as float64 of its bf16 rounding, packed or not."""
    return ops.unpack_linear_weight(t).to(torch.bfloat16).double()


@torch.no_grad()
def post_rope_keys(model: LlamaModel, token_ids: Sequence[int]) -> torch.Tensor:
    """[layers, T, kv_heads, head_dim] float64: each layer's post-RoPE K for a
    causal prefill of ``token_ids`` at positions 0..T-1 (float64 reference
    forward, on the weights rounded to bf16)."""
    cfg = model.cfg
    t = len(token_ids)
    if t < 2:
        raise ValueError(f"K smoothing calibration needs at least 2 tokens, got {t}")
    ids = torch.tensor(token_ids, dtype=torch.int64, device=model.embed_tokens.weight.device)
    x = model.embed_tokens.weight.index_select(0, ids).to(torch.bfloat16).double()
    cos = model.rope_cos[:t].double()[:, None, :]
    sin = model.rope_sin[:t].double()[:, None, :]
    keys = []
    for layer in model.layers:
        h = _rms_norm(x, _w(layer.input_layernorm), cfg.rms_norm_eps)
        bias = layer.qkv_proj.bias
        qkv = F.linear(h, _w(layer.qkv_proj.weight), None if bias is None else _w(bias))
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = _rope(q.reshape(t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = _rope(k.reshape(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        keys.append(k)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, scale=cfg.head_dim ** -0.5,
                                              enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        x = x + F.linear(attn.transpose(0, 1).reshape(t, cfg.q_size), _w(layer.o_proj.weight))
        h = _rms_norm(x, _w(layer.post_attention_layernorm), cfg.rms_norm_eps)
        gate, up = F.linear(h, _w(layer.gate_up_proj.weight)).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, _w(layer.down_proj.weight))
    return torch.stack(keys)


def k_shift_from_keys(keys: torch.Tensor) -> torch.Tensor:
    """``keys`` [layers, T, kv_heads, head_dim] -> b [layers, kv_heads,
    head_dim] float32: each channel's mean over tokens 1..T-1, bf16-rounded."""
    return keys[:, 1:].mean(dim=1).to(torch.bfloat16).float()


def k_smoothing_shift(model: LlamaModel, token_ids: Sequence[int]) -> torch.Tensor:
    """``b`` for ``model`` (see the module docstring), on the model's device."""
    return k_shift_from_keys(post_rope_keys(model, token_ids)).contiguous()
