"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2): RMSNorm, RoPE, GQA,
SwiGLU, tied or untied embeddings.  Projections are fused (qkv, gate_up) so a
layer is a handful of large matmuls; attention reads and writes the paged KV
pool through ``pdcluster.kernels.ops``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pdcluster.kernels import ops
from pdcluster.kernels.kv_quant import is_quantized
from pdcluster.services.engine.forward_batch import ForwardBatch
from pdcluster.services.engine.model.config import ModelConfig
from pdcluster.services.engine.model.rope_scaling import rope_inv_freq


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        h = cfg.hidden_size
        self.qkv_proj = nn.Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.scale = cfg.head_dim ** -0.5

    def attention(self, x: torch.Tensor, batch: ForwardBatch, kv_pool: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, k_shift: torch.Tensor | None = None,
                  rotate_qk: bool = False) -> torch.Tensor:
        """``k_shift``: this layer's K smoothing shift as the pool's K rows carry
        it, for an 8-bit pool (else None); ``rotate_qk``: turn q and K by the
        Hadamard rotation after RoPE (pdcluster/kernels/kv_rotation.py; the model does
        for 8-bit pools), which leaves the output unchanged up to rounding."""
        cfg = self.cfg
        qkv = _project(x, self.qkv_proj)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
        k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = ops.apply_rope(q, k, batch.positions, cos, sin)
        if rotate_qk:
            q, k = ops.rotate_heads(q), ops.rotate_heads(k)
        ops.write_kv(kv_pool, self.index, k, v, batch.slot_mapping, k_shift)
        d = batch.num_decode_tokens
        parts = []
        if d:
            parts.append(ops.paged_decode_attention(
                q[:d], kv_pool, self.index, batch.decode_block_tables, batch.decode_context_lens, self.scale))
        if batch.num_tokens > d:
            chunk = None  # plain pools hold the chunk's K/V as stored; 8-bit ones attend to it as computed
            if is_quantized(kv_pool.dtype):
                chunk = ops.ChunkKV(k[d:], v[d:], batch.prefill_fresh_kv, k_shift)
            parts.append(ops.prefill_attention(
                q[d:], kv_pool, self.index, batch.prefill_block_tables,
                batch.prefill_query_start_loc, batch.prefill_context_lens, self.scale, chunk))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return _project(out.reshape(-1, cfg.q_size), self.o_proj)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return _project(ops.silu_mul(_project(x, self.gate_up_proj)), self.down_proj)

    def projections(self) -> tuple[nn.Linear, ...]:
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj


# The projections' names in a quantized weights file (pdcluster/services/engine/model/weight_quant.py)
PROJECTION_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _project(x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
    """One projection; an int8 one carries its group scales as ``w_scales`` (until packed: then inside)."""
    return ops.linear(x, proj.weight, proj.bias, getattr(proj, "w_scales", None))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # Its weight given, not drawn: the loader builds this on the meta device, where nn.Embedding's own
        # random init imports torch._dynamo (1-1.6 s of every replica's start) for values it then replaces.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)builds the fp32 cos/sin caches; call after moving or casting the model."""
        cfg = self.cfg
        if self.embed_tokens.weight.device.type == "meta":
            return  # built for real after to_empty()
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = ops.rope_cos_sin(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, inv_freq)
        device = self.embed_tokens.weight.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.lm_head_int8 is not None:
            return self.lm_head_int8
        if self.lm_head_packed is not None:
            return self.lm_head_packed
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    lm_head_packed: torch.Tensor | None = None
    # the int8 screen that gives greedy rows their token without the whole bf16 head (kernels/greedy_head.py)
    greedy_screen: ops.ScreenedHead | None = None
    # weight_dtype int8: the LM head's own int8 copy (codes [vocab, hidden] or packed) and its group scales
    lm_head_int8: torch.Tensor | None = None
    lm_head_scales: torch.Tensor | None = None

    weight_scheme: str | None = None  # None: the model dtype's weights; else e.g. "int8" (weight_quant.py)

    @torch.no_grad()
    def quantize_projections(self, quantized: dict[str, torch.Tensor], scheme: str) -> None:
        """Swaps every decoder projection for its int8 codes and group scales (the tensors
        pdcluster/services/engine/model/weight_quant.py draws), and gives the LM head its own int8 copy when
        the file has one; the embedding rows and the norms keep the model dtype."""
        for i, layer in enumerate(self.layers):
            for name, proj in zip(PROJECTION_NAMES, layer.projections()):
                codes, scales = quantized[f"layers.{i}.{name}.codes"], quantized[f"layers.{i}.{name}.scales"]
                if tuple(codes.shape) != (proj.out_features, proj.in_features):
                    raise ValueError(f"quantized layers.{i}.{name} is {tuple(codes.shape)}, the model's is "
                                     f"{(proj.out_features, proj.in_features)}: stale quantized weights")
                proj.weight = nn.Parameter(codes.to(proj.weight.device), requires_grad=False)
                proj.register_buffer("w_scales", scales.to(proj.weight.device, torch.float16))
        if "lm_head.codes" in quantized:  # the head's own copy; a tied embedding keeps its bf16 rows
            device = self.embed_tokens.weight.device
            self.lm_head_int8 = quantized["lm_head.codes"].to(device)
            self.lm_head_scales = quantized["lm_head.scales"].to(device, torch.float16)
        self.weight_scheme = scheme

    @torch.no_grad()
    def pack_weights(self, screen_dir: Path | None = None) -> None:
        """Re-lays the projection weights out for this device's fastest
        ``ops.linear`` (idempotent; a no-op where nothing faster exists).
        The tied lm_head gets its own packed copy: the embedding needs rows.
        ``screen_dir``: where the greedy head's screen is kept once built (ops.build_greedy_head)."""
        for layer in self.layers:
            for proj in layer.projections():
                if proj.weight.dtype == torch.int8:
                    packed = ops.pack_int8_linear_weight(proj.weight, proj.w_scales)
                else:
                    packed = ops.pack_linear_weight(proj.weight)
                proj.weight = nn.Parameter(packed, requires_grad=False)
        if self.lm_head_int8 is not None:
            if self.lm_head_int8.dim() == 2:
                self.lm_head_int8 = ops.pack_int8_linear_weight(self.lm_head_int8, self.lm_head_scales)
        elif self.lm_head is not None:
            self.lm_head.weight = nn.Parameter(ops.pack_linear_weight(self.lm_head.weight), requires_grad=False)
        elif self.lm_head_packed is None:
            packed = ops.pack_linear_weight(self.embed_tokens.weight)
            self.lm_head_packed = packed if packed is not self.embed_tokens.weight else None
        self._stream_weights_from_huge_pages()
        self.native_stack = self._native_stack()
        head = self.lm_head_weight
        if self.greedy_screen is None and head.dim() == 4 and head.dtype is torch.bfloat16:
            self.greedy_screen = ops.build_greedy_head(ops.unpack_linear_weight(head), screen_dir)

    def _stream_weights_from_huge_pages(self) -> None:
        """Moves what a decode step reads end to end (every projection and the LM head's own
        copy) into one mapping on transparent huge pages (pdcluster/kernels/huge_pages.py);
        CPU only, once: the embedding rows, the norms and any tied weight stay put."""
        projections = [proj for layer in self.layers for proj in layer.projections()]
        if self.weights_on_huge_pages or projections[0].weight.device.type != "cpu":
            return
        heads = {"lm_head_packed": self.lm_head_packed, "lm_head_int8": self.lm_head_int8}
        heads = {name: t for name, t in heads.items() if t is not None}
        if self.lm_head is not None:
            projections.append(self.lm_head)
        copies = ops.on_huge_pages([p.weight for p in projections] + list(heads.values()))
        for proj, copy in zip(projections, copies):
            proj.weight = nn.Parameter(copy, requires_grad=False)
        for name, copy in zip(heads, copies[len(projections):]):
            setattr(self, name, copy)
        self.weights_on_huge_pages = True

    weights_on_huge_pages: bool = False

    native_stack: ops.DecoderStack | None = None
    # [layers, kv_heads, head_dim] fp32: subtracted from K before it enters an
    # 8-bit pool (pdcluster/kernels/kv_quant.py, K smoothing); set by the engine from
    # pdcluster/services/engine/model/k_smoothing.py; plain pools never see it
    k_shift: torch.Tensor | None = None
    # 8-bit pools turn q and K by a Hadamard rotation (pdcluster/kernels/kv_rotation.py);
    # off only for an A/B in one process: the block-hash seed assumes it on
    k_rotation: bool = True
    _rotated_shift: tuple[torch.Tensor, torch.Tensor] | None = None  # (k_shift, H k_shift)

    def rotates_kv(self, kv_pool: torch.Tensor) -> bool:
        """Whether q and K turn before they meet ``kv_pool`` (8-bit pools only)."""
        return self.k_rotation and is_quantized(kv_pool.dtype) and ops.rotates(self.cfg.head_dim)

    def pool_k_shift(self, kv_pool: torch.Tensor) -> torch.Tensor | None:
        """The K shift as ``kv_pool``'s K rows carry it: None for plain pools,
        ``H b`` when rotated (computed once per ``k_shift``), else ``b``."""
        if self.k_shift is None or not is_quantized(kv_pool.dtype):
            return None
        if not self.rotates_kv(kv_pool):
            return self.k_shift
        if self._rotated_shift is None or self._rotated_shift[0] is not self.k_shift:
            self._rotated_shift = (self.k_shift, ops.rotate_heads(self.k_shift).contiguous())
        return self._rotated_shift[1]

    def _native_stack(self) -> ops.DecoderStack | None:
        """The fused-layer path, where ops offers it for these weights."""
        cfg = self.cfg
        layers = [(layer.input_layernorm, layer.qkv_proj.weight, layer.qkv_proj.bias, layer.o_proj.weight,
                   layer.post_attention_layernorm, layer.gate_up_proj.weight, layer.down_proj.weight)
                  for layer in self.layers]
        return ops.decoder_stack(layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                                 cfg.head_dim, cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: torch.Tensor) -> torch.Tensor:
        """Returns fp32 logits [len(batch.logits_indices), vocab]."""
        return self.logits(self.final_hidden(batch, kv_pool))

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, kv_pool: torch.Tensor) -> torch.Tensor:
        """The normed last hidden states of the rows in ``batch.logits_indices``: what the LM head takes."""
        eps = self.cfg.rms_norm_eps
        hidden = self.embed_tokens(batch.input_ids)
        k_shift, rotate = self.pool_k_shift(kv_pool), self.rotates_kv(kv_pool)
        if self.native_stack is not None and ops.decoder_stack_takes(kv_pool):  # bf16 or 8-bit KV
            x, residual = self.native_stack.forward(hidden, batch, kv_pool, self.rope_cos, self.rope_sin, k_shift,
                                                    rotate)
        else:
            residual = hidden
            x = ops.rmsnorm(hidden, self.layers[0].input_layernorm, eps)
            for i, layer in enumerate(self.layers):
                if i > 0:
                    x, residual = ops.fused_add_rmsnorm(x, residual, layer.input_layernorm, eps)
                attn = layer.attention(x, batch, kv_pool, self.rope_cos, self.rope_sin,
                                       None if k_shift is None else k_shift[i], rotate)
                x, residual = ops.fused_add_rmsnorm(attn, residual, layer.post_attention_layernorm, eps)
                x = layer.mlp(x)
        residual = residual.index_select(0, batch.logits_indices)
        x = x.index_select(0, batch.logits_indices)
        x, _ = ops.fused_add_rmsnorm(x, residual, self.norm, eps)
        return x

    @torch.inference_mode()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of :meth:`final_hidden`'s rows."""
        return ops.linear(x, self.lm_head_weight, None, self.lm_head_scales).float()

    @torch.inference_mode()
    def greedy_tokens(self, x: torch.Tensor) -> list[int] | None:
        """Each row's argmax of :meth:`logits` (``torch.argmax``'s tie-break), from the int8 screen and
        the candidates' exact logits; None where the screen does not run or cannot decide: take the logits."""
        if self.greedy_screen is None or x.shape[0] > ops.GREEDY_SCREEN_ROWS:
            return None
        return ops.greedy_choice(self.greedy_screen, self.lm_head_weight, x)

    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """Loads weights named as in Hugging Face checkpoints, fusing q/k/v and
        gate/up.  Raises ``KeyError`` naming any missing tensor."""
        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"checkpoint lacks tensor {name!r}")
            return state[name]

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.copy_(take("model.norm.weight"))
            if self.lm_head is not None:
                self.lm_head.weight.copy_(state.get("lm_head.weight", state["model.embed_tokens.weight"]))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.qkv_proj.weight.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if layer.qkv_proj.bias is not None:
                    layer.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                layer.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
                layer.gate_up_proj.weight.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
                layer.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
                layer.input_layernorm.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.copy_(take(p + "post_attention_layernorm.weight"))
