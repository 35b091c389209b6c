"""What a llama-family GGUF holds, in our terms: its metadata as a
ModelConfig, its tensor names as Hugging Face's, and the row order of its q/k
projections.  Torch-free (numpy); pdcluster/services/model_cache.py converts a GGUF
with it, once.

llama.cpp's converter permutes the rows of q/k weights so that RoPE rotates
adjacent pairs; our model rotates halves (the HF convention), so the rows are
permuted back (``unpermute``)."""

from __future__ import annotations

import re

from pdcluster.services.engine.model.config import ModelConfig

GGUF_ARCHS = ("llama", "mistral", "qwen2")

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


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None: not one the model uses."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute(w, n_heads: int):
    """Undo llama.cpp's interleaving of q/k rows (per head: pairs -> halves); numpy in, numpy out."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(reader) -> ModelConfig:
    """The shape from an open ``gguf.GGUFReader``'s metadata."""
    a = _field(reader, "general.architecture")
    if a not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {a!r} is not supported; use llama, mistral or qwen2")
    heads = int(_field(reader, f"{a}.attention.head_count"))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    vocab = _field(reader, f"{a}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    scaling = None
    if _field(reader, f"{a}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{a}.rope.scaling.factor"))}
    return ModelConfig(
        arch=a,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
        num_layers=int(_field(reader, f"{a}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{a}.attention.key_length", hidden // heads)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )
