"""Activation smoothing for W8A8 int8 projections (SmoothQuant's migration,
alpha 0.5), as the retired W8A8 scheme used it: bench/micro/weight_quant_sensitivity.py
still simulates it, nothing in the product does.  Per-token int8 activations lose the small channels of a row
whose scale one outlier channel sets (SmolLM2's attention input: its qkv
projection alone cost 2.4 % perplexity, per-token int8 against weight-only;
gate_up 0.8, down 0.8, o 0.4).  Dividing each input channel k by

    s_k = max |x_k| ** alpha / max_n |W[n, k]| ** (1 - alpha)

and multiplying the weight's column k by s_k leaves the product unchanged
and evens the channels out.  The division folds into whatever made x:

    qkv      input_layernorm weight / s               (the norm's output is x)
    gate_up  post_attention_layernorm weight / s
    lm_head  the final norm's weight / s              (the head's own int8 copy; a tied embedding is untouched)
    down     up_proj rows / s  (x = silu(gate) * up)
    o        v_proj rows (and bias) / s  (x = P V): one s per (kv head, dim),
             shared by the query heads of a group

``max |x_k|`` comes from one causal prefill of the K-smoothing calibration
chat (pdcluster/services/engine/model/k_smoothing.py: built in, never a benchmark's
text) in float64 on the weights rounded to bf16, so every replica derives the
same factors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pdcluster.services.engine.model.k_smoothing import _rms_norm, _rope, _w
from pdcluster.services.engine.model.llama import PROJECTION_NAMES, LlamaModel

ALPHA = 0.5
MIN_FACTOR = 1e-5


@torch.no_grad()
def input_maxima(model: LlamaModel, token_ids: Sequence[int]) -> list[dict[str, torch.Tensor]]:
    """Per layer, per projection (PROJECTION_NAMES): max |x| over the tokens of each input channel, float64;
    then one more entry, ``{"lm_head": ...}``: the final norm's output (the LM head's input)."""
    cfg, t = model.cfg, len(token_ids)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=model.embed_tokens.weight.device)
    x = model.embed_tokens.weight.index_select(0, ids).to(torch.bfloat16).double()
    cos, sin = model.rope_cos[:t].double()[:, None, :], model.rope_sin[:t].double()[:, None, :]
    amax = lambda a: a.abs().amax(dim=0)  # noqa: E731
    maxima = []
    for layer in model.layers:
        found = {}
        h = _rms_norm(x, _w(layer.input_layernorm), cfg.rms_norm_eps)
        found["qkv_proj"] = amax(h)
        bias = layer.qkv_proj.bias
        qkv = F.linear(h, _w(layer.qkv_proj.weight), None if bias is None else _w(bias))
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = _rope(q.reshape(t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = _rope(k.reshape(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                              v.reshape(t, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1),
                                              is_causal=True, scale=cfg.head_dim ** -0.5,
                                              enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        attn = attn.transpose(0, 1).reshape(t, cfg.q_size)
        found["o_proj"] = amax(attn)
        x = x + F.linear(attn, _w(layer.o_proj.weight))
        h = _rms_norm(x, _w(layer.post_attention_layernorm), cfg.rms_norm_eps)
        found["gate_up_proj"] = amax(h)
        gate, up = F.linear(h, _w(layer.gate_up_proj.weight)).chunk(2, dim=-1)
        act = F.silu(gate) * up
        found["down_proj"] = amax(act)
        x = x + F.linear(act, _w(layer.down_proj.weight))
        maxima.append(found)
    maxima.append({"lm_head": amax(_rms_norm(x, _w(model.norm), cfg.rms_norm_eps))})
    return maxima


def factors(x_max: torch.Tensor, w: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """s [K] for input maxima ``x_max`` [K] and weight ``w`` [N, K]."""
    w_max = w.abs().amax(dim=0).double().clamp(min=MIN_FACTOR)
    return (x_max.double().clamp(min=MIN_FACTOR) ** alpha / w_max ** (1 - alpha)).clamp(min=MIN_FACTOR)


def o_factors(x_max: torch.Tensor, w_o: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
              alpha: float = ALPHA) -> torch.Tensor:
    """s [kv heads, head_dim] for o's input maxima ``x_max`` [q_size] and ``w_o`` [N, q_size]: one factor per
    (kv head, dim), over the query heads of its group (it divides that kv head's v row)."""
    group = num_heads // num_kv_heads
    x_max = x_max.double().view(num_kv_heads, group, head_dim).amax(dim=1)
    w_max = w_o.double().abs().view(-1, num_kv_heads, group, head_dim).amax(dim=(0, 2)).clamp(min=MIN_FACTOR)
    return (x_max.clamp(min=MIN_FACTOR) ** alpha / w_max ** (1 - alpha)).clamp(min=MIN_FACTOR)


def smooth_layer(w: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor], num_heads: int,
                 num_kv_heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """One layer's fp32 tensors (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` [N, K];
    ``input_layernorm``, ``post_attention_layernorm``; optional ``qkv_bias``) smoothed: the same function."""
    w = {k: v.double() for k, v in w.items()}
    s = factors(maxima["qkv_proj"], w["qkv_proj"])
    w["qkv_proj"], w["input_layernorm"] = w["qkv_proj"] * s, w["input_layernorm"] / s
    s = factors(maxima["gate_up_proj"], w["gate_up_proj"])
    w["gate_up_proj"], w["post_attention_layernorm"] = w["gate_up_proj"] * s, w["post_attention_layernorm"] / s
    inter = w["down_proj"].shape[1]
    s = factors(maxima["down_proj"], w["down_proj"])
    w["down_proj"] = w["down_proj"] * s
    w["gate_up_proj"][inter:] /= s[:, None]
    group = num_heads // num_kv_heads
    s = o_factors(maxima["o_proj"], w["o_proj"], num_heads, num_kv_heads, head_dim)  # [kv heads, dim]
    w["o_proj"] = w["o_proj"] * s[:, None, :].expand(num_kv_heads, group, head_dim).reshape(-1)
    v0 = w["qkv_proj"].shape[0] - num_kv_heads * head_dim
    w["qkv_proj"][v0:] /= s.reshape(-1)[:, None]
    if "qkv_bias" in w:
        w["qkv_bias"][v0:] /= s.reshape(-1)
    return {k: v.float() for k, v in w.items()}


