"""No request can hurt another, on the real model: extreme sampling values,
poisoned logits, steps that raise, cancelled commands, reservations and
leases that run out.  Every scenario ends with every KV block accounted for."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time

import pytest

from pdcluster.services.engine.async_engine import AsyncEngine
from pdcluster.services.engine_errors import EngineDeadError, InvalidRequestError, RequestFailedError, UnknownRequestError
from pdcluster.services.engine.request import FinishReason
from pdcluster.services.sampling_params import SamplingParams, greedy
from tests.integration.engine.conftest import make_engine


def _no_leak(engine):
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert not engine.requests and not engine.awaiting_kv and not engine.has_unfinished()


@pytest.fixture
def prompt(smol_bf16):
    return smol_bf16.tokenizer.encode("The three primary colours are")


def poison(engine, request_ids: set[str], at_sample: int = 1):
    """Makes the logits row of each request in ``request_ids`` NaN from its
    ``at_sample``-th sampled token on (as a numerical bug in the model would)."""
    inner, seen = engine.runner.sampler.sample_batch, {}

    def sample_batch(logits, rids, params, seeds=None):
        rows = []
        for i, rid in enumerate(rids):
            seen[rid] = seen.get(rid, 0) + 1
            if rid in request_ids and seen[rid] >= at_sample:
                rows.append(i)
        if rows:
            logits = logits.clone()
            logits[rows] = math.nan
        return inner(logits, rids, params, seeds)
    engine.runner.sampler.sample_batch = sample_batch
    engine.runner.screen_greedy = False  # greedy rows too: the poison is in the sampler's logits


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40, 1e-8])
def test_a_vanishing_temperature_is_greedy_not_nan(smol_bf16, prompt, temperature):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    ref = engine.generate([prompt], greedy(8, ignore_eos=True))[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True))[0]
    assert out.error is None and out.new_token_ids == ref.new_token_ids
    tiny_p = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-30, ignore_eos=True))[0]
    assert tiny_p.new_token_ids == ref.new_token_ids  # only the best token survives top-p
    _no_leak(engine)


def test_nan_logits_fail_that_request_while_the_batch_goes_on(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    poison(engine, {"bad"}, at_sample=3)
    for rid in ("a", "bad", "b"):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True))
    outs: dict[str, list] = {"a": [], "bad": [], "b": []}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    bad = outs["bad"]
    assert [len(o.new_token_ids) for o in bad] == [1, 1, 0]
    assert bad[-1].finished and bad[-1].finish_reason is FinishReason.ABORT
    assert "numerical error in this request's logits" in bad[-1].error
    for rid in ("a", "b"):
        assert sum(len(o.new_token_ids) for o in outs[rid]) == 8 and outs[rid][-1].error is None
    assert engine.stats().num_failed_requests == 1 and engine.stats().num_failed_steps == 0
    _no_leak(engine)


async def test_a_step_that_raises_fails_its_requests_and_the_next_one_succeeds(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    real_execute, fail_next = engine.runner.execute, threading.Event()

    def execute(out):
        if fail_next.is_set():
            fail_next.clear()
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_execute(out)
    engine.runner.execute = execute
    aeng = AsyncEngine(engine)
    try:
        got = []
        with pytest.raises(RequestFailedError, match="the engine step running this request failed .*illegal memory"):
            async for o in aeng.generate("victim", prompt, greedy(50, ignore_eos=True)):
                got += o.new_token_ids
                if len(got) == 2:
                    fail_next.set()
        after = [t async for o in aeng.generate("next", prompt, greedy(6, ignore_eos=True)) for t in o.new_token_ids]
        assert len(after) == 6 and aeng.alive
        stats = await aeng.run(lambda e: e.stats())
        assert stats.num_failed_steps == 1 and stats.num_failed_requests == 1
        await aeng.run(_no_leak)
    finally:
        await aeng.shutdown()


def test_steps_that_keep_failing_end_the_engine(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)

    def execute(out):
        raise RuntimeError("device lost")
    engine.runner.execute = execute
    for i in range(2):
        engine.add_request(f"r{i}", prompt, greedy(4))
        (out,) = engine.step()
        assert out.error is not None and "device lost" in out.error
        _no_leak(engine)
    engine.add_request("r2", prompt, greedy(4))
    with pytest.raises(EngineDeadError, match="3 engine steps in a row failed.*restart the replica"):
        engine.step()


def test_a_failed_step_that_leaks_a_block_ends_the_engine(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)

    def execute(out):
        engine.kv.allocate(1)  # a bug: a block nobody owns
        raise RuntimeError("boom")
    engine.runner.execute = execute
    engine.add_request("r", prompt, greedy(4))
    with pytest.raises(EngineDeadError, match="KV bookkeeping is inconsistent"):
        engine.step()


async def _cancel_while_running(aeng, engine, method: str, call):
    """Starts ``call`` (a coroutine using engine.<method>), cancels it while
    that method runs on the engine thread, then lets the method finish."""
    started, release = threading.Event(), threading.Event()
    real = getattr(engine, method)

    def slow(*args, **kw):
        result = real(*args, **kw)
        started.set()
        release.wait(5)
        return result
    setattr(engine, method, slow)
    task = asyncio.create_task(call())
    assert await asyncio.to_thread(started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    setattr(engine, method, real)
    await aeng.run(lambda e: None)  # the undo was queued in the same turn as the command


async def test_a_generate_cancelled_after_add_request_ran_is_aborted(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    aeng = AsyncEngine(engine)
    try:
        async def consume():
            async for _ in aeng.generate("r", prompt, greedy(40, ignore_eos=True)):
                pass
        await _cancel_while_running(aeng, engine, "add_request", consume)
        assert await aeng.run(lambda e: e.num_steps) == 0  # aborted before it was ever scheduled
        await aeng.run(_no_leak)
        assert aeng.alive
    finally:
        await aeng.shutdown()


async def test_a_reservation_cancelled_after_it_ran_gives_its_blocks_back(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    aeng = AsyncEngine(engine)
    try:
        await _cancel_while_running(aeng, engine, "reserve_external",
                                    lambda: aeng.reserve_external("r", prompt, greedy(8)))
        await aeng.run(_no_leak)
    finally:
        await aeng.shutdown()


async def test_a_refused_duplicate_id_leaves_the_request_holding_it_alone(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    aeng = AsyncEngine(engine)
    try:
        assert await aeng.reserve_external("r", prompt, greedy(8)) is not None
        with pytest.raises(InvalidRequestError, match="already in use"):
            async for _ in aeng.generate("r", prompt, greedy(4)):
                pass
        assert await aeng.run(lambda e: "r" in e.awaiting_kv)  # not aborted on the way out
        assert await aeng.abort("r")
        await aeng.run(_no_leak)
    finally:
        await aeng.shutdown()


async def test_closing_a_prefill_stream_after_its_last_output_keeps_the_lease(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    aeng = AsyncEngine(engine)
    try:
        for i in range(5):
            async with contextlib.aclosing(aeng.generate(f"p{i}", prompt, greedy(4), prefill_only=True)) as stream:
                async for out in stream:
                    assert out.finish_reason is FinishReason.PREFILLED
                    break  # what a consumer does once it has the hand-off
            assert await aeng.release_lease(f"p{i}")  # still there for the decode side to pull
        await aeng.run(_no_leak)
    finally:
        await aeng.shutdown()


def test_a_reservation_whose_kv_never_comes_expires(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    assert engine.reserve_external("r", prompt, greedy(8), ttl_s=0.3) is not None
    assert engine.reserve_external("kept", prompt, greedy(8)) is not None  # default TTL: the lease's
    assert engine.reservation_ttl_s == engine.config.lease_ttl_s
    engine.expire_stale()
    assert set(engine.awaiting_kv) == {"r", "kept"}
    time.sleep(0.31)
    engine.expire_stale()
    assert set(engine.awaiting_kv) == {"kept"} and engine.stats().num_expired_reservations == 1
    with pytest.raises(UnknownRequestError, match=r"expired before the K/V came\): call reserve_external again"):
        engine.commit_external("r", 5)
    with pytest.raises(InvalidRequestError, match="first token id -1 is outside"):
        engine.commit_external("kept", -1)
    assert engine.abort("kept")
    _no_leak(engine)


async def test_the_idle_loop_expires_reservations_by_itself(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    aeng = AsyncEngine(engine)
    try:
        assert await aeng.reserve_external("r", prompt, greedy(8), ttl_s=0.1) is not None
        deadline = time.monotonic() + 3.0
        while aeng.stats.num_expired_reservations == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert aeng.stats.num_expired_reservations == 1
        await aeng.run(_no_leak)
    finally:
        await aeng.shutdown()


def _prefill(engine, rid, prompt):
    engine.add_request(rid, prompt, greedy(4), prefill_only=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (done,) = [o for o in outs if o.finished]
    return done.prefill


def test_a_lease_refuses_reads_at_its_deadline_and_frees_after_the_grace(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    engine.leases.default_ttl_s, engine.leases.expiry_grace_s = 0.3, 0.3
    before = time.time()
    pre = _prefill(engine, "x", prompt)
    assert before + 0.3 <= pre.lease_deadline_unix <= time.time() + 0.3
    assert engine.leases.begin_read("x", pre.block_ids) is None
    engine.leases.end_read("x")
    time.sleep(max(0.0, pre.lease_deadline_unix - time.time()) + 0.01)
    assert engine.leases.begin_read("x", pre.block_ids).startswith("lease expired")
    engine.expire_stale()
    assert engine.leases.num_pinned_blocks == len(pre.block_ids)  # within the grace: not recycled yet
    time.sleep(0.31)
    engine.expire_stale()
    assert engine.leases.num_expired == 1 and engine.stats().num_refused_reads == 1
    _no_leak(engine)


def test_a_lease_released_while_read_is_freed_after_the_read(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    pre = _prefill(engine, "x", prompt)
    with pytest.raises(InvalidRequestError, match="still holds the lease of an earlier prefill"):
        engine.add_request("x", prompt, greedy(4), prefill_only=True)
    assert engine.leases.begin_read("x", pre.block_ids) is None
    assert engine.release_lease("x")
    engine.expire_stale()
    assert engine.leases.num_pinned_blocks == len(pre.block_ids)
    engine.check_integrity()  # the draining lease still owns its blocks
    engine.leases.end_read("x")
    engine.expire_stale()
    _no_leak(engine)


def test_shorten_lease_moves_the_hand_offs_deadline(smol_bf16, prompt):
    engine = make_engine(smol_bf16, num_kv_blocks=64)
    pre = _prefill(engine, "x", prompt)
    short = engine.shorten_lease("x", 0.5, pre)
    assert short.lease_deadline_unix < pre.lease_deadline_unix and short.block_ids == pre.block_ids
    assert engine.leases.get("x").deadline_unix == short.lease_deadline_unix
    with pytest.raises(UnknownRequestError):
        engine.shorten_lease("nope", 0.5, pre)
    assert engine.release_lease("x")
    _no_leak(engine)
