"""Scheduler decisions on a tiny pool, no model: exact chunks, block ids,
preemption order and prefix-cache skips."""

import torch

from pdcluster.services.engine.config import SchedulerConfig
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec
from pdcluster.services.engine.request import FinishReason, Request, RequestStatus
from pdcluster.services.sampling_params import greedy
from pdcluster.services.engine.scheduler import Scheduler

BS = 4


def make_scheduler(num_blocks=8, **cfg):
    kv = KVCache(KVCacheSpec(num_blocks, BS, 1, 1, 2, torch.float32))
    return Scheduler(SchedulerConfig(**cfg), kv, hash_seed=42)


def make_request(rid, n_prompt, max_tokens=8, first=0):
    return Request(rid, list(range(first, first + n_prompt)), greedy(max_tokens))


def step(s, token=7):
    """One scheduled step with a fake model that always samples ``token``."""
    out = s.schedule()
    sampled = {e.request.request_id: token for e in out.scheduled if e.samples}
    s.update(out, sampled)
    for req in list(s.running):
        req.check_invariants(BS)
    s.kv.check_integrity()
    return out


def test_chunked_prefill_then_decode_within_budget():
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=8, prefill_chunk_size=5)
    a = make_request("a", 12)
    s.add(a)
    out = step(s)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.prefills] == [("a", 5)]
    assert a.block_ids == [0, 1] and a.num_computed_tokens == 5 and not a.output_token_ids
    step(s)  # 5 more
    out = step(s)  # last 2 prompt tokens, samples the first output token
    assert out.prefills[0].num_new_tokens == 2 and a.output_token_ids == [7]
    out = step(s)
    assert [e.num_new_tokens for e in out.decodes] == [1] and a.num_computed_tokens == 13


def test_budget_is_shared_decode_first():
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=6, prefill_chunk_size=16)
    a, b = make_request("a", 3), make_request("b", 10, first=100)
    s.add(a)
    step(s)  # a prefilled (3 tokens)
    s.add(b)
    out = step(s)
    assert [e.request.request_id for e in out.decodes] == ["a"]
    assert [(e.request.request_id, e.num_new_tokens) for e in out.prefills] == [("b", 5)]


def test_preempts_newest_by_recompute_and_keeps_its_full_blocks_cached():
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=32, kv_watermark_high=1.0, kv_watermark_low=1.0)
    a, b = make_request("a", 7, max_tokens=10), make_request("b", 6, max_tokens=10, first=50)
    s.add(a)
    s.add(b)
    step(s)
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    step(s)  # a: 8 tokens fit in 2 blocks; b: 7 tokens fit
    out = step(s)  # a needs a 3rd block -> b (newest) preempted
    assert out.preempted == [b] and b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert a.block_ids == [0, 1, 3] and s.waiting[0] is b
    assert s.num_preemptions == 1
    # b's first full block (tokens 50..53) stayed in the prefix cache as block 2.
    assert s.kv.match_prefix(b.block_hashes[:1], b.all_token_ids).block_ids == (2,)


def test_waiting_request_reuses_cached_prefix_and_skips_compute():
    s = make_scheduler(num_blocks=16)
    a = make_request("a", 10, max_tokens=1)
    s.add(a)
    step(s)
    s.finish(a, FinishReason.LENGTH)
    b = Request("b", list(range(10)) + [99, 98], greedy(4))
    s.add(b)
    out = step(s)
    # 2 full blocks (8 tokens) hit; only 4 suffix tokens are computed.
    assert b.num_cached_tokens == 8 and out.prefills[0].num_new_tokens == 4
    assert b.block_ids[:2] == a.block_ids[:0] + [0, 1]


def test_full_hit_still_computes_the_last_token():
    s = make_scheduler(num_blocks=16)
    a = make_request("a", 8, max_tokens=1)
    s.add(a)
    step(s)
    s.finish(a, FinishReason.LENGTH)
    b = make_request("b", 8)
    s.add(b)
    out = step(s)
    assert b.num_cached_tokens == 4 and [e.num_new_tokens for e in out.prefills] == [4]


def test_max_num_seqs_caps_running():
    s = make_scheduler(num_blocks=10, max_num_seqs=2)
    for i in range(3):
        s.add(make_request(str(i), 4, first=10 * i))
    step(s)
    assert [r.request_id for r in s.running] == ["0", "1"] and len(s.waiting) == 1


def test_high_watermark_pauses_admission_until_usage_below_low():
    s = make_scheduler(num_blocks=10, kv_watermark_high=0.5, kv_watermark_low=0.35)
    reqs = [make_request(str(i), 8, max_tokens=1, first=10 * i) for i in range(3)]
    for r in reqs:
        s.add(r)
    step(s)
    # 2 blocks each: usage 0.2, 0.4, then 0.6 > 0.5 -> the third waits.
    assert [r.request_id for r in s.running] == ["0", "1"] and s.waiting[0] is reqs[2]
    s.finish(reqs[0], FinishReason.LENGTH)   # usage 0.3 (b grew a block) < 0.35: reopens
    step(s)
    assert reqs[2] in s.running


def test_finish_keep_blocks_hands_them_over():
    s = make_scheduler()
    a = make_request("a", 5)
    s.add(a)
    step(s)
    blocks = s.finish(a, FinishReason.PREFILLED, keep_blocks=True)
    assert blocks == [0, 1] and s.kv.num_free_blocks == 6
    s.kv.free(blocks)
    assert s.kv.num_free_blocks == 8


def test_reserve_external_takes_cached_blocks_then_commit_runs_it():
    s = make_scheduler()
    a = make_request("a", 9, max_tokens=1)
    s.add(a)
    step(s)  # a's two full blocks (0, 1) enter the prefix cache; a finished by max_tokens below
    s.finish(a, FinishReason.LENGTH)
    b = make_request("b", 10)  # same first 9 tokens: two cached blocks, one new
    assert s.reserve_external(b) == 2
    assert b.block_ids == [0, 1, 3] and b.num_cached_tokens == 8 and b.num_computed_tokens == 0
    assert b.status is RequestStatus.WAITING_FOR_KV and s.awaiting_kv == {"b": b} and s.num_unfinished == 0
    assert s.commit_external("b", 42) is b
    assert b.status is RequestStatus.RUNNING and s.running == [b] and not s.awaiting_kv
    assert b.num_computed_tokens == 10 and b.output_token_ids == [42]
    out = step(s)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.decodes] == [("b", 1)]
    assert s.commit_external("b", 42) is None  # nothing reserved under that id any more


def test_reserve_external_refuses_what_the_pool_cannot_hold():
    s = make_scheduler(num_blocks=2)
    assert s.reserve_external(make_request("a", 9)) is None
    assert not s.awaiting_kv and s.kv.num_free_blocks == 2


def test_finish_frees_a_reservation():
    s = make_scheduler()
    a = make_request("a", 8)
    s.reserve_external(a)
    s.finish(a, FinishReason.ABORT)
    assert not s.awaiting_kv and a.block_ids == [] and s.kv.num_free_blocks == 8


def test_resumed_request_enters_with_its_prior_output_and_recomputes_it():
    s = make_scheduler(num_blocks=16)
    a = make_request("a", 5, max_tokens=8)
    s.add(a, prior_output_token_ids=[70, 71, 72])
    assert a.output_token_ids == [70, 71, 72] and a.num_tokens == 8
    out = step(s, token=9)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.prefills] == [("a", 8)]
    assert a.output_token_ids == [70, 71, 72, 9] and a.num_prompt_tokens == 5


def test_a_resumed_request_reserves_its_prior_output_too_and_decodes_after_it():
    s = make_scheduler(num_blocks=16)
    a = make_request("a", 9, max_tokens=1)
    s.add(a)
    step(s)  # a's two full blocks (0, 1) enter the prefix cache
    s.finish(a, FinishReason.LENGTH)
    # Resumed: the same 9 prompt tokens, 4 output tokens sent before the hop: 13 tokens of K/V from outside.
    b = make_request("b", 9, max_tokens=8)
    b.output_token_ids.extend([70, 71, 72, 73])
    assert s.reserve_external(b) == 2
    assert b.block_ids == [0, 1, 3, 4] and b.num_cached_tokens == 8 and b.num_computed_tokens == 0
    assert s.commit_external("b", 42) is b
    assert b.num_computed_tokens == 13 and b.output_token_ids == [70, 71, 72, 73, 42]
    assert len(b.block_hashes) == 3  # the prior output's full block is hashed and cached with the prompt's
    assert s.kv.match_prefix(b.block_hashes, b.all_token_ids).num_blocks == 3
    out = step(s, token=9)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.decodes] == [("b", 1)]
    assert b.num_computed_tokens == 14 and b.output_token_ids[-1] == 9
    s.finish(b, FinishReason.LENGTH)
    s.kv.check_integrity()
    assert s.kv.num_free_blocks == 16


def test_a_resumed_reservation_is_refused_when_its_prior_output_does_not_fit():
    s = make_scheduler(num_blocks=3)
    b = make_request("b", 9, max_tokens=8)  # 3 blocks for the prompt alone would fit
    b.output_token_ids.extend([70, 71, 72, 73])
    assert s.reserve_external(b) is None
    assert not s.awaiting_kv and s.kv.num_free_blocks == 3


def test_a_forced_hash_collision_is_recomputed_not_served_from_the_other_prompts_block():
    """(d) Two prompts, one set of hashes (as a gateway header could send):
    the second prompt takes no block of the first, on both ways in."""
    s = make_scheduler(num_blocks=16)
    a = make_request("a", 9, max_tokens=1)
    s.add(a)
    step(s)  # a's two full blocks enter the prefix cache under its hashes
    s.finish(a, FinishReason.LENGTH)
    forged = list(a.block_hashes[:2])
    b = Request("b", list(range(100, 109)), greedy(1), block_hashes=list(forged))
    s.add(b)
    out = step(s)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.prefills] == [("b", 9)]
    assert b.num_cached_tokens == 0 and not set(b.block_ids) & {0, 1}
    c = Request("c", list(range(200, 209)), greedy(1), block_hashes=list(forged))
    assert s.reserve_external(c) == 0 and c.num_cached_tokens == 0 and not set(c.block_ids) & {0, 1}
    assert s.kv.num_hash_mismatches == 2
    s.kv.check_integrity()


def test_on_borrowed_cores_a_step_takes_fewer_prompt_tokens_and_every_decode():
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=16, prefill_chunk_size=16, borrowed_prefill_tokens=3)
    a, b, c = make_request("a", 2), make_request("b", 10, first=100), make_request("c", 10, first=200)
    s.add(a)
    step(s)                      # a prefilled, decoding from now on
    s.add(b)
    s.add(c)
    s.borrowing = True
    out = step(s)
    assert [e.request.request_id for e in out.decodes] == ["a"]   # decodes are not counted against it
    assert [(e.request.request_id, e.num_new_tokens) for e in out.prefills] == [("b", 3)]
    out = step(s)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.prefills] == [("b", 3)]   # oldest first
    s.borrowing = False          # its own cores again: the whole budget
    out = step(s)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.prefills] == [("b", 4), ("c", 10)]


def test_a_prefill_replica_finishes_its_oldest_prompt_first_and_a_decode_replica_keeps_its_chunk():
    from pdcluster.services.config import ClusterConfig, SchedulerSettings

    cfg = ClusterConfig(scheduler=SchedulerSettings(max_num_batched_tokens=1024, prefill_chunk_size=512,
                                                    decode_step_prefill_tokens=256, borrowed_prefill_tokens=96))
    prefill, decode = cfg.engine_config(cfg.prefill).scheduler, cfg.engine_config(cfg.decode).scheduler
    assert (prefill.max_num_batched_tokens, prefill.prefill_chunk_size) == (1024, 1024)
    assert decode.prefill_chunk_size == 256 and prefill.borrowed_prefill_tokens == decode.borrowed_prefill_tokens == 96
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=16, prefill_chunk_size=16)
    s.add(make_request("a", 12))
    s.add(make_request("b", 12, first=100))
    out = step(s)
    assert [(e.request.request_id, e.num_new_tokens) for e in out.prefills] == [("a", 12), ("b", 4)]


def _chunks(out):
    return [(e.request.request_id, e.num_new_tokens) for e in out.prefills]


def test_short_prompts_go_ahead_of_a_long_prefill_which_takes_what_the_step_leaves():
    # long_prefill_tokens 8: a prompt with more than 8 tokens left to compute yields.
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=12, prefill_chunk_size=12, long_prefill_tokens=8)
    s.add(make_request("long", 40))
    assert _chunks(step(s)) == [("long", 12)]            # alone: the whole step
    s.add(make_request("chat", 5, first=100))
    assert _chunks(step(s)) == [("chat", 5), ("long", 7)]  # the chat first, the long one the rest
    out = step(s)
    assert [e.request.request_id for e in out.decodes] == ["chat"] and _chunks(out) == [("long", 11)]


def test_one_long_prefill_at_a_time_and_short_ones_pass_a_waiting_long_one():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=12, prefill_chunk_size=12, long_prefill_tokens=8)
    s.add(make_request("long1", 30))
    s.add(make_request("long2", 30, first=100))
    s.add(make_request("chat", 4, first=200))
    assert _chunks(step(s)) == [("long1", 12)]           # queue order: long1 admitted, long2 waits ...
    assert [r.request_id for r in s.waiting] == ["long2", "chat"]
    assert _chunks(step(s)) == [("chat", 4), ("long1", 8)]  # ... and the chat behind it goes ahead
    assert [r.request_id for r in s.waiting] == ["long2"]
    while s.running[0].num_computed_tokens < 30:
        step(s)
    assert _chunks(step(s))[0][0] == "long2"               # long1 done: long2's turn


def test_the_rule_off_keeps_arrival_order():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=12, prefill_chunk_size=12)
    s.add(make_request("long", 40))
    step(s)
    s.add(make_request("chat", 5, first=100))
    assert _chunks(step(s)) == [("long", 12)]


def test_a_long_prefill_never_preempts_what_the_step_already_took():
    # 6 blocks of 4: the long prompt holds 3 after its first step, then the chat takes 2 and one is free.
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=16, prefill_chunk_size=12, long_prefill_tokens=8,
                       kv_watermark_high=1.0, kv_watermark_low=0.99)
    s.add(make_request("long", 24))
    assert _chunks(step(s)) == [("long", 12)]
    s.add(make_request("chat", 8, first=100))
    out = step(s)
    assert _chunks(out) == [("chat", 8), ("long", 4)] and not out.preempted  # 8 would fit the step: 1 free block
    assert all(r.status is RequestStatus.RUNNING for r in s.running)
    s.kv.check_integrity()


def test_long_prefill_settings_are_checked():
    import pytest

    with pytest.raises(ValueError, match="long_prefill_tokens"):
        SchedulerConfig(long_prefill_tokens=-1)
    with pytest.raises(ValueError, match="max_long_prefills"):
        SchedulerConfig(max_long_prefills=0)
