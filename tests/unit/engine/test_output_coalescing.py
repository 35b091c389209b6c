"""Outputs that pile up behind a busy consumer leave as one, in order, and
never swallow the end of a stream or an error."""

import asyncio

import pytest

from pdcluster.services.engine.async_engine import AsyncEngine
from pdcluster.services.engine_errors import EngineDeadError
from pdcluster.services.engine.outputs import PrefillResult, RequestOutput
from pdcluster.services.engine.request import FinishReason


def out(tokens, text, finished=False, **kw):
    return RequestOutput("r", list(tokens), text, finished, FinishReason.LENGTH if finished else None, **kw)


def test_followed_by_concatenates_and_keeps_the_latest_counts():
    pre = PrefillResult(5, (1, 2), 20, 0)
    merged = out([5], "a", num_output_tokens=1, prefill=pre, first_scheduled_s=1.0).followed_by(
        out([6, 7], "bc", finished=True, num_output_tokens=3, num_prompt_tokens=20))
    assert merged.new_token_ids == [5, 6, 7] and merged.text_delta == "abc"
    assert merged.finished and merged.finish_reason is FinishReason.LENGTH
    assert merged.num_output_tokens == 3 and merged.num_prompt_tokens == 20
    assert merged.prefill is pre and merged.first_scheduled_s == 1.0


async def collect(items):
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    got = []
    try:
        async for o in AsyncEngine._drain(None, "r", queue):  # _drain uses only its queue
            got.append(o)
    except EngineDeadError as exc:
        got.append(exc)
    return got


def test_a_backlog_is_merged_up_to_the_end_of_the_stream():
    got = asyncio.run(collect([out([1], "x"), out([2], "y"), out([3], "z", finished=True), out([9], "late")]))
    assert len(got) == 1 and got[0].new_token_ids == [1, 2, 3] and got[0].finished


def test_an_error_behind_a_backlog_still_arrives():
    dead = EngineDeadError("engine loop died")
    got = asyncio.run(collect([out([1], "x"), out([2], "y"), dead]))
    assert got[0].new_token_ids == [1, 2] and got[1] is dead


def test_outputs_delivered_one_at_a_time_are_not_delayed():
    async def paced():
        queue: asyncio.Queue = asyncio.Queue()
        seen = []

        async def produce():
            for i in range(3):
                queue.put_nowait(out([i], str(i), finished=i == 2))
                await asyncio.sleep(0.01)

        task = asyncio.create_task(produce())
        async for o in AsyncEngine._drain(None, "r", queue):
            seen.append(o.new_token_ids)
        await task
        return seen

    assert asyncio.run(paced()) == [[0], [1], [2]]
