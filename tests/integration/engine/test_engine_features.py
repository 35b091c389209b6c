"""Prefix reuse, the disaggregation hooks, sampling controls, bad input and
the async front, on the real model."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdcluster.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
from pdcluster.prefix_store.hashing import hash_prompt_blocks
from pdcluster.services.engine.async_engine import AsyncEngine
from pdcluster.services.engine_errors import InvalidRequestError, RequestTooLongError
from pdcluster.services.engine.request import FinishReason
from pdcluster.services.sampling_params import SamplingParams, greedy
from tests.integration.engine.conftest import document, make_engine


def _no_leak(engine):
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_shared_512_token_prefix_computes_only_the_suffix(smol_fp32):
    tok = smol_fp32.tokenizer
    prefix = tok.encode(document(60))[:512]
    first, second = prefix + tok.encode(" Question one:"), prefix + tok.encode(" A different ending here:")
    engine = make_engine(smol_fp32)
    engine.generate([first], greedy(8))
    computed_before = engine.stats().prompt_tokens_computed
    out = engine.generate([second], greedy(16))[0]
    computed = engine.stats().prompt_tokens_computed - computed_before
    assert out.num_cached_tokens == 512
    assert computed == len(second) - 512
    fresh = make_engine(smol_fp32).generate([second], greedy(16))[0]
    assert out.new_token_ids == fresh.new_token_ids
    _no_leak(engine)


def _run(engine, rid, prompt, params, block_hashes):
    engine.add_request(rid, prompt, params, block_hashes=block_hashes)
    tokens, cached = [], None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens if o.finished else cached
    return tokens, cached


def test_a_forced_hash_collision_is_not_served_from_the_other_prompts_blocks(smol_fp32):
    """(d) Two prompts sent with one set of block hashes (as a gateway's
    header carries them): the second is computed, not read from the first's
    blocks, and its greedy output equals a fresh engine's."""
    tok = smol_fp32.tokenizer
    # The answer sits in the second prompt's first block: read from the first prompt's K/V, it is lost.
    second = tok.encode("The secret code word is tangerine. " + document(6) + " Again, the secret code word is")
    first = tok.encode(document(14, 2))[:len(second)]
    engine = make_engine(smol_fp32)
    bs = engine.kv_spec.block_size
    forged = hash_prompt_blocks(engine.hash_seed, first, bs)[:len(second) // bs]  # the first prompt's
    params = greedy(12, ignore_eos=True)
    _run(engine, "a", first, params, forged)
    out, cached = _run(engine, "b", second, params, forged)
    fresh, _ = _run(make_engine(smol_fp32), "b", second, params, ())
    assert out == fresh
    assert cached == 0 and engine.kv.num_hash_mismatches == 1
    _no_leak(engine)


def test_quarantined_blocks_stay_out_of_reuse_until_released(smol_fp32):
    """(a) A pull in doubt (its READ may still land): the reservation ends, its
    other blocks go back, the in-doubt ones stay held -- no other request can
    get them, not even by taking every free block -- until release_quarantine."""
    tok = smol_fp32.tokenizer
    engine = make_engine(smol_fp32)
    engine.generate([tok.encode(document(3))], greedy(2))  # some blocks in the prefix cache
    prompt = tok.encode(document(3)) + tok.encode(" and then something else entirely, at length." * 4)
    alloc = engine.reserve_external("r", prompt, greedy(4))
    assert alloc.num_cached_blocks >= 1 and alloc.missing_block_ids
    in_doubt = alloc.missing_block_ids
    free_before = engine.kv.num_free_blocks
    key = engine.quarantine("r", in_doubt)
    assert key is not None and engine.stats().quarantined_blocks == len(in_doubt)
    assert "r" not in engine.awaiting_kv
    engine.check_integrity()  # the quarantine owns its blocks
    # The reservation's other blocks came back; the held ones did not.
    assert engine.kv.num_free_blocks == free_before + len(alloc.block_ids) - len(in_doubt)
    everything = engine.kv.allocate(engine.kv.num_free_blocks)  # another request takes all it can
    assert not set(everything) & set(in_doubt)
    engine.kv.free(everything)
    assert engine.quarantine("r", in_doubt) is None  # nothing reserved under the id any more
    assert engine.release_quarantine(key) == len(in_doubt) and engine.stats().quarantined_blocks == 0
    assert engine.release_quarantine(key) == 0
    _no_leak(engine)


def test_the_more_urgent_request_runs_first_and_its_output_is_unchanged(smol_fp32):
    """priority (vLLM's, lower first) on the real engine with one seat: the urgent
    request, added after the batch one, finishes first; each output equals its own
    run alone (priority orders the work, it changes no token)."""
    tok = smol_fp32.tokenizer
    batch, urgent = tok.encode("Write a long story about a lighthouse."), tok.encode("The capital of France is")
    low = dataclasses.replace(greedy(6, ignore_eos=True), priority=5)
    high = dataclasses.replace(greedy(6, ignore_eos=True), priority=-5)
    engine = make_engine(smol_fp32, max_num_seqs=1)
    engine.add_request("batch", batch, low)
    engine.add_request("urgent", urgent, high)
    finished, tokens = [], {"batch": [], "urgent": []}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finished.append(o.request_id)
    assert finished == ["urgent", "batch"]
    alone = make_engine(smol_fp32).generate([batch, urgent], greedy(6, ignore_eos=True))
    assert [tokens["batch"], tokens["urgent"]] == [o.new_token_ids for o in alone]
    _no_leak(engine)


def test_prefill_only_then_external_kv_decode_equals_one_engine(smol_fp32):
    tok = smol_fp32.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about " + document(5)}])
    params = greedy(24, ignore_eos=True)
    whole = make_engine(smol_fp32).generate([prompt], params)[0].new_token_ids

    prefill, decode = make_engine(smol_fp32), make_engine(smol_fp32)
    decode.generate([prompt[:40] + [7, 8, 9]], greedy(2))  # decode side already holds 2 leading blocks
    prefill.add_request("r", prompt, params, prefill_only=True)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    (done,) = [o for o in outs if o.finished]
    assert done.finish_reason is FinishReason.PREFILLED and done.prefill.num_tokens == len(prompt)
    assert prefill.leases.num_pinned_blocks == len(done.prefill.block_ids)

    alloc = decode.reserve_external("r", prompt, params)
    assert alloc.num_cached_blocks == 2
    remote = done.prefill.block_ids[alloc.num_cached_blocks:]
    import torch
    buf = gather_blocks_ref(prefill.kv.kv_pool, torch.tensor(remote))
    scatter_blocks_ref(decode.kv.kv_pool, torch.tensor(alloc.missing_block_ids), buf)
    assert prefill.release_lease("r")
    _no_leak(prefill)
    decode.commit_external("r", done.prefill.first_token_id)
    tokens = [done.prefill.first_token_id]
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == whole
    _no_leak(decode)


def test_expired_lease_frees_blocks(smol_bf16):
    engine = make_engine(smol_bf16)
    engine.leases.default_ttl_s, engine.leases.expiry_grace_s = 0.01, 0.0
    engine.add_request("x", [1, 2, 3, 4, 5] * 10, greedy(4), prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.leases.num_pinned_blocks > 0
    import time
    time.sleep(0.02)
    engine.step()
    assert engine.leases.num_expired == 1
    _no_leak(engine)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(smol_bf16):
    engine = make_engine(smol_bf16)
    prompt = smol_bf16.tokenizer.encode("The weather today is")
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    # Run alone each time: rows of one bf16 batch may round differently.
    a = engine.generate([prompt], p)[0]
    b = engine.generate([prompt], p)[0]
    assert a.new_token_ids == b.new_token_ids
    k1 = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True))[0]
    assert k1.new_token_ids == engine.generate([prompt], greedy(12, ignore_eos=True))[0].new_token_ids
    _no_leak(engine)


def test_stop_strings_and_stop_token_ids(smol_bf16):
    engine = make_engine(smol_bf16)
    prompt = smol_bf16.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    full = engine.generate([prompt], greedy(20))[0]
    # a stop string taken from the middle of the greedy text (which word the
    # bf16 model picks first is a near-tie that kernels may flip)
    mid = len(full.text_delta) // 2
    stop = full.text_delta[mid:mid + 4]
    assert stop.strip(), full.text_delta
    stopped = engine.generate([prompt], greedy(20, stop=(stop,)))[0]
    assert stopped.finish_reason is FinishReason.STOP and stopped.text_delta == full.text_delta.split(stop)[0]
    by_id = engine.generate([prompt], greedy(20, stop_token_ids=(full.new_token_ids[2],)))[0]
    assert by_id.new_token_ids == full.new_token_ids[:3] and by_id.finish_reason is FinishReason.STOP
    assert engine.generate([prompt], greedy(2))[0].finish_reason is FinishReason.LENGTH
    _no_leak(engine)


@pytest.mark.parametrize("make, match", [
    (lambda e: e.add_request("a", [], greedy(4)), "prompt is empty"),
    (lambda e: e.add_request("a", [1] * 9000, greedy(4)), "context is 8192"),
    (lambda e: e.add_request("a", [1] * 8000, greedy(500)), "lower max_tokens to at most 192"),
    (lambda e: e.add_request("a", [1, 2], greedy(100_000)), "context is 8192"),
    (lambda e: e.add_request("a", [1, 10**9], greedy(4)), "outside this model's vocabulary"),
    (lambda e: SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
    (lambda e: SamplingParams(temperature=-1), "temperature must be >= 0"),
    (lambda e: SamplingParams(top_p=0), r"top_p must be in \(0, 1\]"),
    (lambda e: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (lambda e: SamplingParams(stop=[1, 2]), "stop must be a string or a list of strings"),
])
def test_bad_input_is_a_typed_error_naming_the_fix(smol_bf16, make, match):
    engine = make_engine(smol_bf16)
    with pytest.raises(InvalidRequestError, match=match):
        make(engine)
    _no_leak(engine)


def test_request_larger_than_pool_is_refused_at_admission(smol_bf16):
    engine = make_engine(smol_bf16, num_kv_blocks=8)
    with pytest.raises(RequestTooLongError, match="raise kv_cache_bytes"):
        engine.add_request("a", [1] * 100, greedy(64))


async def test_async_engine_streams_and_consumer_leaving_aborts(smol_bf16):
    engine = make_engine(smol_bf16)
    aeng = AsyncEngine(engine)
    try:
        prompt = smol_bf16.tokenizer.encode("Count with me: one, two, three,")

        async def collect(rid, n):
            toks = []
            async for out in aeng.generate(rid, prompt, greedy(n, ignore_eos=True)):
                toks += out.new_token_ids
            return toks

        a, b = await asyncio.gather(collect("a", 10), collect("b", 6))
        assert len(a) == 10 and a[:6] == b
        stream = aeng.generate("c", prompt, greedy(200, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        await aeng.run(lambda e: None)  # a round trip through the engine thread
        assert await aeng.run(lambda e: (e.has_unfinished(), e.kv.num_free_blocks == e.kv.num_total_blocks)) == (False, True)
        with pytest.raises(InvalidRequestError):
            async for _ in aeng.generate("d", [], greedy(3)):
                pass
    finally:
        await aeng.shutdown()
    _no_leak(engine)
