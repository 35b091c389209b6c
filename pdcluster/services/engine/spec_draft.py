"""A draft model for speculative decoding: a small model (or the target's own
first N layers: an early-exit draft) proposes k tokens greedily; the target
verifies them in its step's one forward (spec_decode.py, unchanged).

The draft keeps its own K/V, dense and per sequence, apart from the paged
pool: the target's K/V is not the draft's (another model, or the same one cut
after N layers), and a request that arrived by a KV hand-off has the target's
prompt K/V only.  So the draft catches up on every token it has not seen::

    request tokens   p0 .. pm  o0 .. on                (prompt + output)
    draft cache      p0 .. pm  o0 .. oj  d1' d2'        (from its last proposal:
                     \\____ shared prefix ___/            its rejected drafts d' past it)
    propose          truncate to the shared prefix, feed o(j+1) .. on (the whole
                     prompt at first: in chunks), then d1, d2, .. d(k-1) one at a time;
                     d_j = argmax of the draft's logits after the token before it

After a verification the shared prefix is exactly the accepted length, so
the truncation is the roll-back of the draft's rejected slots.  At least the
last token is always fed: its logits give d1.

Memory: a sequence's cache grows by doubling (in steps of ``GROW_TOKENS``) up
to max_model_len positions of the draft's layers, so the draft holds at most
max_num_seqs x max_model_len x draft layers x 2 x kv_heads x head_dim
elements (``bytes_held`` says what it holds now).  A request's cache goes
when it ends, is aborted or is preempted (Speculator.forget / preempted).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pdcluster.kernels import ops
from pdcluster.services.engine.config import SpeculativeConfig
from pdcluster.services.default_model import resolve_model_path
from pdcluster.services.engine.model.llama import LlamaModel
from pdcluster.services.engine.model.loader import LoadedModel, load_model
from pdcluster.services.engine.request import Request
from pdcluster.services.model_cache import derived_dir

GROW_TOKENS = 256      # a sequence's cache grows by doubling, in multiples of this
CATCH_UP_CHUNK = 256   # tokens per draft forward when catching up (a prompt after a hand-off)


def shared_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def tokenizer_mismatch(target: LoadedModel, draft: LoadedModel) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (its token ids would mean
    other text), or None when vocabulary, tokens and EOS ids agree."""
    if draft.config.vocab_size != target.config.vocab_size:
        return f"vocabulary of {draft.config.vocab_size} tokens, the target's has {target.config.vocab_size}"
    if tuple(draft.tokenizer.eos_token_ids) != tuple(target.tokenizer.eos_token_ids):
        return f"EOS ids {draft.tokenizer.eos_token_ids}, the target's are {target.tokenizer.eos_token_ids}"
    if draft.tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab():
        return "a tokenizer whose tokens differ from the target's"
    return None


class DenseKV:
    """One sequence's draft K/V: ``k``/``v`` [layers, capacity, kv_heads,
    head_dim]; rows [0, len(token_ids)) are valid."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
                 max_tokens: int):
        self.shape = (num_layers, 0, num_kv_heads, head_dim)
        self.dtype, self.device, self.max_tokens = dtype, device, max_tokens
        self.k = torch.empty(self.shape, dtype=dtype, device=device)
        self.v = torch.empty(self.shape, dtype=dtype, device=device)
        self.token_ids: list[int] = []

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def reserve(self, num_tokens: int) -> None:
        """Room for ``num_tokens`` rows (the valid ones kept)."""
        if num_tokens <= self.capacity:
            return
        if num_tokens > self.max_tokens:
            raise ValueError(f"draft cache asked for {num_tokens} positions, max_model_len is {self.max_tokens}")
        cap = max(num_tokens, 2 * self.capacity)
        cap = min(-(-cap // GROW_TOKENS) * GROW_TOKENS, self.max_tokens)
        n = len(self.token_ids)
        layers, _, heads, dim = self.shape
        for name in ("k", "v"):
            grown = torch.empty((layers, cap, heads, dim), dtype=self.dtype, device=self.device)
            grown[:, :n] = getattr(self, name)[:, :n]
            setattr(self, name, grown)

    def truncate(self, num_tokens: int) -> None:
        del self.token_ids[num_tokens:]


class DraftModel:
    """The first ``num_layers`` decoder layers of ``model``, then its final
    norm and LM head, run densely over one sequence's DenseKV."""

    def __init__(self, model: LlamaModel, num_layers: int):
        self.model, self.num_layers = model, num_layers
        self.layers = list(model.layers[:num_layers])
        self.cfg = model.cfg

    def new_cache(self, max_tokens: int) -> DenseKV:
        p = self.model.embed_tokens.weight
        return DenseKV(self.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, p.dtype, str(p.device), max_tokens)

    @torch.inference_mode()
    def forward(self, cache: DenseKV, token_ids: Sequence[int]) -> torch.Tensor:
        """Appends ``token_ids`` to ``cache`` (their K/V written) and returns
        the fp32 logits [vocab] after the last of them."""
        cfg, m, eps = self.cfg, self.model, self.cfg.rms_norm_eps
        start, t = len(cache.token_ids), len(token_ids)
        cache.reserve(start + t)
        device = m.embed_tokens.weight.device
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
        positions = torch.arange(start, start + t, device=device)
        # causal over the cache: query i (position start + i) sees keys 0 .. start + i
        mask = None if t == 1 else torch.ones(t, start + t, dtype=torch.bool, device=device).tril(start)
        residual = m.embed_tokens(ids)
        x = ops.rmsnorm(residual, self.layers[0].input_layernorm, eps)
        for i, layer in enumerate(self.layers):
            if i > 0:
                x, residual = ops.fused_add_rmsnorm(x, residual, layer.input_layernorm, eps)
            qkv = ops.linear(x, layer.qkv_proj.weight, layer.qkv_proj.bias, getattr(layer.qkv_proj, "w_scales", None))
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.reshape(t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            q, k = ops.apply_rope(q, k, positions, m.rope_cos, m.rope_sin)
            cache.k[i, start:start + t] = k
            cache.v[i, start:start + t] = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            keys, values = cache.k[i, :start + t].transpose(0, 1), cache.v[i, :start + t].transpose(0, 1)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                                  scale=layer.scale, enable_gqa=True)
            attn = ops.linear(attn.transpose(0, 1).reshape(t, cfg.q_size), layer.o_proj.weight, None,
                              getattr(layer.o_proj, "w_scales", None))
            x, residual = ops.fused_add_rmsnorm(attn, residual, layer.post_attention_layernorm, eps)
            x = layer.mlp(x)
        cache.token_ids.extend(token_ids)
        x, _ = ops.fused_add_rmsnorm(x[-1:].contiguous(), residual[-1:].contiguous(), m.norm, eps)
        return ops.linear(x, m.lm_head_weight, None, m.lm_head_scales).float()[0]  # int8 weights: their scales


class DraftProposer:
    """spec_decode.Proposer by a draft model: greedy, one DenseKV per request."""

    def __init__(self, draft: DraftModel, max_model_len: int):
        self.draft, self.max_model_len = draft, max_model_len
        self._caches: dict[str, DenseKV] = {}
        self.num_forwards = 0          # draft forwards run (catch-up chunks and one-token steps)
        self.num_drafted_tokens = 0
        self.draft_seconds = 0.0       # wall time inside propose

    def propose(self, req: Request, k: int) -> list[int]:
        tokens = req.all_token_ids
        k = min(k, self.max_model_len - len(tokens))  # the last draft's position stays inside the context
        if k < 1:
            return []
        t0 = time.perf_counter()
        cache = self._caches.get(req.request_id)
        if cache is None:
            cache = self._caches[req.request_id] = self.draft.new_cache(self.max_model_len)
        cache.truncate(min(shared_prefix_len(cache.token_ids, tokens), len(tokens) - 1))
        logits = None
        for i in range(len(cache.token_ids), len(tokens), CATCH_UP_CHUNK):
            logits = self._feed(cache, tokens[i:i + CATCH_UP_CHUNK])
        draft = [int(logits.argmax())]
        while len(draft) < k:
            draft.append(int(self._feed(cache, draft[-1:]).argmax()))
        self.num_drafted_tokens += len(draft)
        self.draft_seconds += time.perf_counter() - t0
        return draft

    def _feed(self, cache: DenseKV, token_ids: Sequence[int]) -> torch.Tensor:
        self.num_forwards += 1
        return self.draft.forward(cache, token_ids)

    def release(self, request_id: str) -> None:
        self._caches.pop(request_id, None)

    @property
    def num_sequences(self) -> int:
        return len(self._caches)

    @property
    def bytes_held(self) -> int:
        return sum(c.num_bytes for c in self._caches.values())


def build_draft_proposer(config: SpeculativeConfig, target: LoadedModel, dtype: str, device: str,
                         max_model_len: int) -> DraftProposer:
    """The proposer ``config`` (method draft) asks for.  A draft that names
    the target's own weights shares them (nothing loaded twice); another is
    loaded here and must tokenize as the target does.  Raises ValueError
    naming the field to fix."""
    path = resolve_model_path(config.draft_model)
    if path.resolve() == target.path.resolve():
        draft = target
    else:
        draft = load_model(str(path), dtype, device)
        problem = tokenizer_mismatch(target, draft)
        if problem:
            raise ValueError(f"speculative.draft_model {config.draft_model!r} has {problem}: a draft must share "
                             "the target's tokenizer; pick a model of the same family, or 'default'")
        draft.model.pack_weights(screen_dir=derived_dir())
    total = draft.config.num_layers
    n = config.draft_num_layers or total
    if n > total:
        raise ValueError(f"speculative.draft_num_layers is {n}, but the draft model has {total} decoder layers: "
                         f"give 1 .. {total}")
    return DraftProposer(DraftModel(draft.model, n), max_model_len)
