"""A prefill replica borrows idle neighbours' cores (pdcluster/services/pools/core_lending.py):
the rule as a table, the board reader against a real redis-server, and the
engine's results unchanged by the thread count it computes with."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from pdcluster.services.pools.core_lending import borrow_forever, borrowed_threads, host_id, is_idle

IDLE = {"engine_alive": True, "running": 0, "waiting": 0, "awaiting_kv": 0, "in_flight": 0}


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


async def test_the_borrower_follows_the_board_and_gives_the_threads_back(redis_server):
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_server.url)
    applied: list[int] = []
    host = host_id()

    async def put(**load):
        await client.set("pdc:status:lend:dec", json.dumps(entry("dec", host=host, **load)))

    async def until(n: int):
        for _ in range(400):  # bounded: 400 x 0.01 s reads
            if applied and applied[-1] == n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"never applied {n}: {applied}")

    await put()
    task = asyncio.create_task(borrow_forever(redis_server.url, "lend", "me", 1, applied.append, period_s=0.01))
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
    assert applied[-1] == 1          # cancelled while borrowing: own threads again


def test_the_engine_computes_the_same_logits_on_one_thread_and_on_two():
    from pdcluster.services.engine.config import EngineConfig
    from pdcluster.services.engine.engine import Engine
    from pdcluster.services.engine.sampling_params import SamplingParams

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
