"""A replica borrows idle neighbours' cores (pdcluster/services/pools/core_lending.py,
busy_flag.py): the rule as a table, the busy bytes in real shared-memory files,
the board reader against a real redis-server, and the engine's results
unchanged by the thread count it computes with, even when it changes every step."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdcluster.services.pools.busy_flag import BusyFlag, FlagReader, flag_path, remove_flags
from pdcluster.services.pools.status_board import put_status
from pdcluster.services.pools.core_lending import (NOTHING, Lending, ThreadChooser, borrow_forever,
                                                  host_id, is_idle, lending, threads_now)

IDLE = {"engine_alive": True, "running": 0, "waiting": 0, "awaiting_kv": 0, "in_flight": 0}


def borrowed_threads(own: int, me: str, host: str, board: list[dict], cpus: int) -> int:
    """The threads by the board alone (no busy byte to read)."""
    return threads_now(own, lending(own, me, host, board, cpus), None)


def entry(name: str, host: str = "h1", threads: int = 1, **load) -> dict:
    return {"name": name, "host": host, "threads": threads, **IDLE, **load}


@pytest.mark.parametrize("board, cpus, want", [
    ([entry("me")], 2, 1),                                               # alone on its host: nothing to borrow
    ([entry("me"), entry("dec")], 2, 2),                                 # the decode replica idles: its core too
    ([entry("me"), entry("dec", running=3)], 2, 1),                      # it decodes: own core only
    ([entry("me"), entry("dec", waiting=1)], 2, 1),
    ([entry("me"), entry("dec", awaiting_kv=1)], 2, 1),                  # it is about to pull a hand-off
    ([entry("me"), entry("dec", in_flight=1)], 2, 1),
    ([entry("me"), entry("dec", engine_alive=False, running=2)], 2, 2),  # a dead engine computes nothing
    ([entry("me"), entry("dec", threads=4)], 2, 2),                      # capped at the host's CPUs
    ([entry("me"), entry("dec", host="h2")], 2, 1),                      # another host's idle cores are not ours
    ([entry("me"), entry("dec"), entry("p2", running=1)], 3, 1),         # any busy neighbour: own only
    ([entry("me"), entry("dec"), entry("p2")], 3, 3),
])
def test_threads_borrowed_from_idle_neighbours_on_the_same_host(board, cpus, want):
    assert borrowed_threads(1, "me", "h1", board, cpus) == want


def test_a_replica_with_own_threads_never_drops_below_them():
    assert borrowed_threads(2, "me", "h1", [entry("me", threads=2), entry("dec", threads=1)], 2) == 2
    assert is_idle({}) and not is_idle({"running": 1})


@pytest.fixture
def redis_server():
    from pdcluster.prefix_store.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.mark.parametrize("lend, busy, want", [
    (NOTHING, False, 1),                                   # nothing to borrow
    (Lending(1, ("dec",), board_idle=False), False, 2),    # the byte says idle: the board's lag does not matter
    (Lending(1, ("dec",), board_idle=True), True, 1),      # the byte says busy: given back at once
    (Lending(1, ("dec",), board_idle=True), None, 2),      # no byte to read: the board decides
    (Lending(1, ("dec",), board_idle=False), None, 1),
])
def test_threads_for_the_next_step(lend, busy, want):
    assert threads_now(1, lend, busy) == want


def test_what_the_board_lends():
    board = [entry("me"), entry("dec", threads=3, running=1), entry("far", host="h2")]
    assert lending(1, "me", "h1", board, 2) == Lending(1, ("dec",), board_idle=False)
    assert lending(1, "me", "h1", [entry("me")], 2) == NOTHING


def test_busy_bytes_in_shared_memory_give_the_cores_back_before_the_next_step(tmp_path):
    flag = BusyFlag(flag_path("c/1", "dec", tmp_path))
    chooser = ThreadChooser(1, "c/1", tmp_path)
    try:
        assert chooser() == 1                                        # nothing lent yet
        chooser.update(Lending(1, ("dec",), board_idle=False))
        assert chooser() == 2                                        # its byte says idle
        flag.set(True)
        assert chooser() == 1                                        # a request arrived there
        flag.set(False)
        assert chooser() == 2 and chooser.num_changes == 3
        chooser.update(Lending(1, ("gone",), board_idle=False))
        assert chooser() == 1                                        # no file: the board's view (busy)
    finally:
        flag.close()
        chooser.reader.close()
    assert not flag.path.exists() and FlagReader().any_busy([flag.path]) is None


def test_a_flag_unmapped_while_the_engine_reads_it_reads_as_unknown(tmp_path):
    # The board reader (event loop) unmaps a departed neighbour's flag while the engine thread may hold it.
    flag = BusyFlag(flag_path("c", "dec", tmp_path))
    reader = FlagReader()
    assert reader.any_busy([flag.path]) is False
    reader._maps[flag.path].close()
    assert reader.any_busy([flag.path]) is None
    flag.close()


def test_a_stopped_cluster_leaves_no_flag_of_its_own(tmp_path):
    mine = [BusyFlag(flag_path("c1", name, tmp_path)) for name in ("prefill-a", "decode-b")]
    other = BusyFlag(flag_path("c2", "decode-c", tmp_path))
    mine[0].set(True)                          # a replica killed with a request in flight never clears its byte
    assert remove_flags("c1", tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.path.name]
    other.close()


async def test_the_borrower_follows_the_board_and_gives_the_threads_back(redis_server):
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_server.url)
    lends: list[Lending] = []
    applied: list[int] = []

    def apply(lend: Lending) -> None:
        lends.append(lend)
        applied.append(threads_now(1, lend, None))
    host = host_id()

    async def put(**load):
        # An hour's TTL: the neighbour must not expire while a stalled test machine runs it (the
        # unit tests run at idle priority beside the cluster tests).
        await put_status(client, "lend", "dec", entry("dec", host=host, **load), ttl_s=3600)

    async def until(n: int):
        for _ in range(400):  # bounded: 400 x 0.01 s reads
            if applied and applied[-1] == n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never applied {n}: {applied}")

    await put()
    task = asyncio.create_task(borrow_forever(redis_server.url, "lend", "me", 1, apply, period_s=0.01))
    try:
        await until(2)               # the neighbour idles: two threads
        await put(running=1)
        await until(1)               # it got work: given back
        await put()
        await until(2)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.aclose()
    assert applied[-1] == 1 and lends[-1] == NOTHING  # cancelled while borrowing: own threads again


def test_the_engine_computes_the_same_logits_on_one_thread_and_on_two():
    from pdcluster.services.engine.config import EngineConfig
    from pdcluster.services.engine.engine import Engine
    from pdcluster.services.sampling_params import SamplingParams

    engine = Engine(EngineConfig(num_kv_blocks=64, num_threads=1, enable_prefix_caching=False))
    if not engine._native:
        pytest.skip("the native kernels do not build here: the thread count is torch's")
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List ten facts about the moon, each in a full sentence. " * 6}])
    runs = []
    for threads in (1, 2, 1):
        engine.set_compute_threads(threads)
        out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=3))[0]
        runs.append((out.new_token_ids, [lp.top for lp in out.logprobs]))
    engine.set_compute_threads(1)
    assert len(prompt) > 100
    assert runs[0] == runs[1] == runs[2]


def test_a_thread_count_that_changes_every_step_changes_no_token_or_logprob():
    from pdcluster.services.engine.config import EngineConfig
    from pdcluster.services.engine.engine import Engine
    from pdcluster.services.sampling_params import SamplingParams

    engine = Engine(EngineConfig(num_kv_blocks=96, num_threads=1, enable_prefix_caching=False))
    if not engine._native:
        pytest.skip("the native kernels do not build here: the thread count is torch's")
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in
               ("Name three rivers.", "Why is the sky blue? " * 8, "Count to five.")]
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)

    def run():
        return [(o.new_token_ids, [lp.top for lp in o.logprobs]) for o in engine.generate(prompts, params)]

    fixed = run()
    asked: list[int] = []

    def one_then_two() -> int:
        asked.append(1 + len(asked) % 2)
        return asked[-1]

    engine.threads_source = one_then_two
    try:
        flipping = run()
    finally:
        engine.threads_source = None
        engine.set_compute_threads(1)
    assert len(asked) >= 10          # asked before every step: a batch of three decoding together
    assert flipping == fixed


def test_the_scheduler_knows_when_the_engine_computes_on_borrowed_cores():
    from pdcluster.services.engine.config import EngineConfig
    from pdcluster.services.engine.engine import Engine

    engine = Engine(EngineConfig(num_kv_blocks=16, num_threads=1))
    if not engine._native:
        pytest.skip("the native kernels do not build here: the thread count is torch's")
    seen = []
    for threads in (2, 1):
        engine.threads_source = lambda n=threads: n
        engine.step()
        seen.append(engine.scheduler.borrowing)
    engine.threads_source = None
    engine.set_compute_threads(1)
    assert seen == [True, False]
