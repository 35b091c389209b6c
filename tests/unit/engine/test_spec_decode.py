"""Speculative decoding without a model: what a verified step emits, that
point-mass rejection sampling keeps the target distribution, the back-off,
and the scheduler's roll-back of rejected drafts (exact block ids)."""

import torch

from pdcluster.services.engine.categorical import draw
from pdcluster.services.engine.config import SchedulerConfig, SpeculativeConfig
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.request import Request
from pdcluster.services.sampling_params import SamplingParams, greedy
from pdcluster.services.engine.scheduler import Scheduler
from pdcluster.services.engine.spec_decode import BACKOFF_STEPS, Speculator, emitted_tokens, verify_sampled

BS = 4


def test_emitted_tokens_are_the_agreeing_drafts_then_one_more():
    assert emitted_tokens([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]   # all accepted + the bonus token
    assert emitted_tokens([5, 9, 7, 8], [5, 6, 7]) == [5, 9]         # d2 rejected: the target's token instead
    assert emitted_tokens([4, 6, 7, 8], [5, 6, 7]) == [4]            # nothing accepted: plain decoding's token


def _sampled_counts(probs: torch.Tensor, draft: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token, and of the second given the first was accepted."""
    g = torch.Generator().manual_seed(1234)
    first = torch.zeros(probs.shape[1])
    second = torch.zeros(probs.shape[1])
    for _ in range(n):
        out = verify_sampled(lambda j: probs[j], draft, lambda j: g)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_point_mass_rejection_sampling_keeps_the_target_distribution():
    # vocabulary of 5; the draft proposes token 1 then token 3
    p = torch.tensor([[0.10, 0.40, 0.20, 0.25, 0.05],
                      [0.30, 0.05, 0.15, 0.35, 0.15]])
    n = 6000
    first, second = _sampled_counts(p, [1], n)
    # chi-square with 4 degrees of freedom: 18.47 is the 0.001 critical value
    assert _chi_square(first, p[0]) < 18.47, first
    assert abs(first[1] / n - 0.40) < 0.03          # accepted with probability p(draft)
    residual = p[0].clone()
    residual[1] = 0
    rejected = first.clone()
    rejected[1] = 0
    assert _chi_square(rejected[residual > 0], (residual / residual.sum())[residual > 0]) < 16.27  # 3 dof
    # the token after an accepted draft follows the next row's distribution
    assert second.sum() == first[1]
    assert _chi_square(second, p[1]) < 18.47, second


def test_a_seeded_verification_draws_what_plain_sampling_draws():
    p = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8]])

    def gen(j):  # the random stream: one generator per output position
        return torch.Generator().manual_seed(100 + j)

    plain = [draw(p[j], gen(j)) for j in range(3)]
    out = verify_sampled(lambda j: p[j], plain[:2], gen)
    assert out == plain


def make_request(rid, prompt, max_tokens=16):
    return Request(rid, list(prompt), greedy(max_tokens))


def test_back_off_after_a_window_of_low_acceptance():
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4, ngram_min=1, window_tokens=8))
    req = make_request("a", [1, 2, 3, 1, 2, 3, 1, 2])
    assert spec.propose(req, 100) == [3, 1, 2]
    spec.record("a", 4, 0)
    spec.record("a", 4, 1)     # window of 8 proposed, 1 accepted < 0.3
    assert spec.num_backoffs == 1
    assert all(spec.propose(req, 100) == [] for _ in range(BACKOFF_STEPS))
    assert spec.propose(req, 100) == [3, 1, 2]
    spec.record("a", 4, 4)
    spec.record("a", 4, 3)     # a good window: no back-off
    assert spec.num_backoffs == 1 and spec.propose(req, 100) == [3, 1, 2]
    assert (spec.num_proposed_tokens, spec.num_accepted_tokens, spec.num_verify_steps) == (16, 8, 4)


def test_no_draft_with_penalties_grammar_or_past_max_tokens():
    spec = Speculator(SpeculativeConfig(method="ngram", ngram_min=1))
    prompt = [1, 2, 1, 2, 1]
    assert spec.propose(Request("p", prompt, SamplingParams(max_tokens=8, frequency_penalty=0.5)), 100) == []
    assert spec.propose(Request("m", prompt, greedy(8, min_tokens=2)), 100) == []
    assert spec.propose(make_request("last", prompt, max_tokens=1), 100) == []   # the one token is all it gets
    assert spec.propose(make_request("two", prompt, max_tokens=2), 100) == [2]  # k capped by max_tokens - 1


def test_rejected_drafts_give_their_blocks_back():
    kv = KVCache(KVCacheSpec(16, BS, 1, 1, 2, torch.float32))
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4, ngram_min=2))
    s = Scheduler(SchedulerConfig(), kv, hash_seed=42, speculator=spec)
    # prompt of 6: "5 6 7 8 | 5 6"; after the first token 7 the suffix "6 7" proposes 8 5 6 7
    req = make_request("a", [5, 6, 7, 8, 5, 6])
    s.add(req)
    out = s.schedule()
    s.update(out, {"a": 7})
    assert req.block_ids == [0, 1] and req.num_computed_tokens == 6
    out = s.schedule()
    (entry,) = out.prefills
    assert entry.spec_token_ids == [8, 5, 6, 7] and entry.num_new_tokens == 5
    assert req.block_ids == [0, 1, 2]                   # positions 6..10 need a third block
    s.update(out, {}, {"a": [8, 9]})                     # 8 accepted, then 9 instead of 5
    assert req.output_token_ids == [7, 8, 9]
    assert req.num_computed_tokens == 8 and req.block_ids == [0, 1]  # block 2 held only rejected slots
    assert kv.num_free_blocks == 14
    req.check_invariants(BS)
    kv.check_integrity()
    s.finish(req, None)
    assert kv.num_free_blocks == 16


def test_a_verification_reads_every_key_from_the_pool_and_a_prompt_chunk_its_own():
    """ForwardBatch.prefill_fresh_kv: a draft's verification must compute what
    the plain decode steps it stands for compute (they read the pool), a prompt
    chunk attends to its own K/V as computed (pdcluster/kernels/prefill_attention.py)."""
    from pdcluster.services.engine.runner import ModelRunner

    kv = KVCache(KVCacheSpec(16, BS, 1, 1, 2, torch.float32))
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4, ngram_min=2))
    s = Scheduler(SchedulerConfig(), kv, hash_seed=42, speculator=spec)
    req = make_request("a", [5, 6, 7, 8, 5, 6])
    s.add(req)
    s.update(s.schedule(), {"a": 7})
    s.add(make_request("b", [1, 2, 3]))
    out = s.schedule()
    batch = ModelRunner(None, kv).build_batch(out)[0]
    flags = {e.request.request_id: int(f) for e, f in zip(out.prefills, batch.prefill_fresh_kv)}
    assert flags == {"a": 0, "b": 1} and out.prefills[0].spec_token_ids
    for r in list(s.running):
        s.finish(r, None)
    assert kv.num_free_blocks == 16
