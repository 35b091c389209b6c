"""The draft-model proposer on a tiny random Llama in fp32: its dense forward
computes what the paged model computes, in chunks or token by token; it
catches up on unseen tokens, rolls back rejected drafts, frees a request's
cache on release and on preemption; the config refuses what cannot work,
naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pdcluster.services.engine.config import SchedulerConfig, SpeculativeConfig
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.model.config import ModelConfig
from pdcluster.services.default_model import default_model_path
from pdcluster.services.engine.model.llama import LlamaModel
from pdcluster.services.engine.model.loader import LoadedModel
from pdcluster.services.engine.request import Request
from pdcluster.services.sampling_params import greedy
from pdcluster.services.engine.scheduler import Scheduler
from pdcluster.services.engine.spec_decode import Speculator
from pdcluster.services.engine.spec_draft import (DraftModel, DraftProposer, build_draft_proposer, shared_prefix_len,
                                        tokenizer_mismatch)

VOCAB = 64


def tiny_model() -> LlamaModel:
    cfg = ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.reset_rope()
    model.pack_weights()
    return model.eval()


def paged_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """The engine's own forward (paged pool, prefill kernel): logits after each token."""
    from pdcluster.services.engine.forward_batch import ForwardBatch

    cfg, n, bs = model.cfg, len(ids), 4
    kv = KVCache(KVCacheSpec(8, bs, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32))
    blocks = kv.allocate(-(-n // bs))
    empty = torch.zeros(0, len(blocks), dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(n),
        slot_mapping=torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)]),
        num_decode_tokens=0, decode_block_tables=empty, decode_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=torch.tensor([blocks], dtype=torch.int32),
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32), logits_indices=torch.arange(n),
        prefill_fresh_kv=torch.ones(1, dtype=torch.int32))
    return model(batch, kv.kv_pool)


IDS = [(7 * p + 3) % VOCAB for p in range(13)]


def test_dense_forward_equals_the_paged_model_in_chunks_or_token_by_token():
    model = tiny_model()
    want = paged_logits(model, IDS)
    draft = DraftModel(model, model.cfg.num_layers)
    whole = draft.new_cache(64)
    torch.testing.assert_close(draft.forward(whole, IDS), want[-1], rtol=1e-4, atol=1e-4)
    stepwise = draft.new_cache(64)
    draft.forward(stepwise, IDS[:5])                    # a chunk, then one token at a time
    for i in range(5, len(IDS)):
        torch.testing.assert_close(draft.forward(stepwise, IDS[i:i + 1]), want[i], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stepwise.k[:, :len(IDS)], whole.k[:, :len(IDS)], rtol=1e-5, atol=1e-5)


def test_an_early_exit_draft_is_the_first_layers_then_norm_and_head():
    model = tiny_model()
    cut = tiny_model()
    cut.layers = cut.layers[:1]                         # the same weights, one layer
    want = paged_logits(cut, IDS)[-1]
    early = DraftModel(model, 1)
    cache = early.new_cache(64)
    got = early.forward(cache, IDS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cache.k.shape[0] == 1                        # K/V for the layers it runs only
    assert not torch.allclose(got, paged_logits(model, IDS)[-1], atol=1e-2)


def test_shared_prefix_len():
    assert shared_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert shared_prefix_len([1, 2, 9, 9], [1, 2, 3]) == 2
    assert shared_prefix_len([], [1]) == 0


def test_proposer_catches_up_rolls_back_and_releases():
    model = tiny_model()
    proposer = DraftProposer(DraftModel(model, 3), max_model_len=64)
    req = Request("a", IDS[:9], greedy(16))
    draft = proposer.propose(req, 4)
    assert len(draft) == 4 and proposer.num_sequences == 1
    cache = proposer._caches["a"]
    assert cache.token_ids == IDS[:9] + draft[:3]       # the last draft's K/V is never needed
    # greedy: each draft token is the argmax after the ones before it
    reference = DraftModel(model, 3)
    ref_cache = reference.new_cache(64)
    assert int(reference.forward(ref_cache, IDS[:9]).argmax()) == draft[0]
    assert int(reference.forward(ref_cache, draft[:1]).argmax()) == draft[1]
    # verification accepted d1, then the target chose another token: the cache rolls back to t d1
    other = (draft[1] + 1) % VOCAB
    req.output_token_ids += [draft[0], other]
    again = proposer.propose(req, 2)
    assert cache.token_ids == req.all_token_ids + again[:1]
    assert int(reference.forward(reference.new_cache(64), req.all_token_ids).argmax()) == again[0]
    proposer.release("a")
    assert proposer.num_sequences == 0 and proposer.bytes_held == 0


def test_proposals_stay_inside_max_model_len():
    proposer = DraftProposer(DraftModel(tiny_model(), 2), max_model_len=12)
    assert len(proposer.propose(Request("a", IDS[:10], greedy(16)), 4)) == 2
    assert proposer.propose(Request("b", IDS[:12], greedy(16)), 4) == []
    assert proposer._caches["a"].capacity <= 12


def test_a_preempted_request_loses_its_draft_cache():
    """Two requests over a 3-block pool: the newer is preempted when both
    need a second block; its draft cache goes with its blocks."""
    proposer = DraftProposer(DraftModel(tiny_model(), 3), max_model_len=64)
    spec = Speculator(SpeculativeConfig(method="draft", draft_model="default", num_tokens=2), proposer)
    kv = KVCache(KVCacheSpec(3, 4, 1, 1, 2, torch.float32))
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, hash_seed=1, speculator=spec)
    a, b = Request("a", IDS[:3], greedy(16)), Request("b", IDS[3:6], greedy(16))
    s.add(a)
    s.add(b)
    s.update(s.schedule(), {"a": 1, "b": 2})            # prompts done: one block each, one free
    out = s.schedule()                                  # both asked for drafts; no spare block to hold them
    assert not any(e.spec_token_ids for e in out.scheduled) and proposer.num_sequences == 2
    s.update(out, {"a": 1, "b": 2})
    out = s.schedule()                                  # a takes the last block; b must go
    assert out.preempted == [b] and set(proposer._caches) == {"a"}
    for r in (a, b):
        s.finish(r, None)
        spec.forget(r.request_id)
    assert proposer.num_sequences == 0 and kv.num_free_blocks == 3


def test_config_refuses_what_cannot_work_naming_the_field():
    with pytest.raises(ValueError, match="speculative.method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="speculative.draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft_model and draft_num_layers apply to method draft"):
        SpeculativeConfig(method="ngram", draft_model="default")
    with pytest.raises(ValueError, match="speculative.draft_num_layers"):
        SpeculativeConfig(method="draft", draft_model="default", draft_num_layers=0)
    model = tiny_model()
    target = LoadedModel(model.cfg, model, tokenizer=None, path=default_model_path(), name="tiny", weights_id="t")
    spec = SpeculativeConfig(method="draft", draft_model="default", draft_num_layers=4)
    with pytest.raises(ValueError, match="draft_num_layers is 4, but the draft model has 3"):
        build_draft_proposer(spec, target, "float32", "cpu", 64)
    ok = build_draft_proposer(SpeculativeConfig(method="draft", draft_model="default", draft_num_layers=2),
                              target, "float32", "cpu", 64)
    assert ok.draft.model is model and ok.draft.num_layers == 2   # the target's own weights: nothing loaded


def _loaded(vocab_size: int, vocab: dict[str, int], eos: tuple[int, ...]) -> SimpleNamespace:
    """A stand-in with only what tokenizer_mismatch reads (the real tokenizer: tests/integration)."""
    tok = SimpleNamespace(eos_token_ids=eos, hf=SimpleNamespace(get_vocab=lambda: dict(vocab)))
    return SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size), tokenizer=tok)


def test_tokenizer_mismatch_names_what_differs():
    base = _loaded(3, {"a": 0, "b": 1, "c": 2}, (2,))
    assert tokenizer_mismatch(base, _loaded(3, {"a": 0, "b": 1, "c": 2}, (2,))) is None
    assert "vocabulary of 4 tokens" in tokenizer_mismatch(base, _loaded(4, {"a": 0}, (2,)))
    assert "EOS ids" in tokenizer_mismatch(base, _loaded(3, {"a": 0, "b": 1, "c": 2}, (1,)))
    assert "tokens differ" in tokenizer_mismatch(base, _loaded(3, {"a": 0, "b": 2, "c": 1}, (2,)))


def test_cluster_config_maps_the_draft_settings_and_refuses_bad_ones():
    from pdcluster.services.config import ClusterConfig

    cfg = ClusterConfig.model_validate({"speculative": {"method": "draft", "draft_model": "default",
                                                        "draft_num_layers": 8}})
    spec = cfg.engine_config(cfg.decode).speculative
    assert (spec.method, spec.draft_model, spec.draft_num_layers) == ("draft", "default", 8)
    assert cfg.engine_config(cfg.prefill).speculative.method == "none"  # prefill replicas never draft
    with pytest.raises(ValueError, match="speculative.draft_model"):
        ClusterConfig.model_validate({"speculative": {"method": "draft"}})
    with pytest.raises(ValueError, match="draft_num_layers"):
        ClusterConfig.model_validate({"speculative": {"method": "draft", "draft_model": "default",
                                                      "draft_num_layers": 0}})
