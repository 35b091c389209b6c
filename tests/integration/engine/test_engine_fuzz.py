"""Random requests through one AsyncEngine on the real model: extreme and
denormal temperatures, tiny top-p, any top-k, seeds, stop lists at their
limits, prefill-only hand-offs, consumers that leave early and requests
whose logits turn NaN.  Every request must end (finished, or a typed error
for exactly the poisoned ones), the engine must stay alive, and every KV
block must come back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcluster.services.engine.async_engine import AsyncEngine
from pdcluster.services.engine_errors import RequestFailedError
from pdcluster.services.engine.request import FinishReason
from pdcluster.services.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from tests.integration.engine.conftest import make_engine

TEMPERATURES = [0, 5e-324, 1e-300, 1e-40, 1e-8, 1e-5, 0.5, 2, 100, 1e30]
TOP_PS = [1e-30, 1e-5, 0.1, 0.5, 0.9, 1.0]
# The most and the longest stop strings a request may have.
LONGEST_STOPS = [chr(ord("a") + i % 26) * (MAX_STOP_STRING_CHARS - i) for i in range(MAX_STOP_STRINGS)]
_ids = itertools.count()


@dataclass
class Case:
    prompt: list[int]
    params: SamplingParams
    prefill_only: bool
    poisoned: bool
    leave_after: int | None  # the consumer stops reading after this many outputs


@pytest.fixture(scope="module")
def fuzz_engine(smol_bf16):
    engine = make_engine(smol_bf16, num_kv_blocks=16, max_num_seqs=3)
    poisoned: set[str] = set()
    inner = engine.runner.sampler.sample_batch

    def sample_batch(logits, rids, params, seeds=None):
        rows = [i for i, rid in enumerate(rids) if rid in poisoned]
        if rows:
            logits = logits.clone()
            logits[rows] = math.nan
        return inner(logits, rids, params, seeds)
    engine.runner.sampler.sample_batch = sample_batch
    engine.runner.screen_greedy = False  # greedy rows too: the poison is in the sampler's logits
    aeng = AsyncEngine(engine)
    yield aeng, poisoned
    asyncio.run(aeng.shutdown())


def cases(vocab: int) -> st.SearchStrategy[Case]:
    stop = st.one_of(st.lists(st.text(alphabet=" aeinorst.,\n", min_size=1, max_size=6), max_size=4),
                     st.just(LONGEST_STOPS))
    params = st.builds(
        SamplingParams, max_tokens=st.integers(1, 6), temperature=st.sampled_from(TEMPERATURES),
        top_p=st.sampled_from(TOP_PS), top_k=st.integers(0, vocab + 5),
        seed=st.none() | st.integers(-2**63, 2**64 - 1), stop=stop,
        stop_token_ids=st.lists(st.integers(0, vocab - 1), max_size=3), ignore_eos=st.booleans())
    return st.builds(Case, prompt=st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40), params=params,
                     prefill_only=st.sampled_from([False, False, True]), poisoned=st.sampled_from([False] * 4 + [True]),
                     leave_after=st.none() | st.integers(1, 2))


async def run_case(aeng: AsyncEngine, poisoned: set[str], rid: str, case: Case) -> None:
    if case.poisoned:
        poisoned.add(rid)  # its first sampled row turns NaN
    outs, error = [], None
    try:
        async with contextlib.aclosing(aeng.generate(rid, case.prompt, case.params, case.prefill_only)) as stream:
            async for out in stream:
                outs.append(out)
                if case.leave_after is not None and len(outs) >= case.leave_after:
                    break
    except RequestFailedError as exc:
        error = exc
    if case.poisoned:
        assert error is not None and "numerical error" in str(error) and not outs, (rid, outs)
        return
    assert error is None, (rid, case, error)
    assert outs
    last, tokens = outs[-1], [t for o in outs for t in o.new_token_ids]
    assert len(tokens) <= case.params.max_tokens and last.error is None
    if case.leave_after is not None and not last.finished:
        return  # left early: the engine aborted it
    assert last.finished
    if last.finish_reason is FinishReason.PREFILLED:
        assert case.prefill_only and last.prefill.lease_deadline_unix > time.time()
        assert await aeng.release_lease(rid)
        return
    assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), last
    text = "".join(o.text_delta for o in outs)
    assert not any(s in text for s in case.params.stop), (text, case.params.stop)
    if last.finish_reason is FinishReason.LENGTH:
        assert len(tokens) == case.params.max_tokens


def check_idle(engine) -> None:
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert not engine.requests and not engine.awaiting_kv and len(engine.leases) == 0


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_requests_all_end_and_the_engine_survives(fuzz_engine, data):
    aeng, poisoned = fuzz_engine
    batch = data.draw(st.lists(cases(aeng.engine.loaded.config.vocab_size), min_size=1, max_size=4))

    async def run_batch():
        rids = [f"fuzz-{next(_ids)}" for _ in batch]
        cases_ = asyncio.gather(*(run_case(aeng, poisoned, r, c) for r, c in zip(rids, batch)))
        await asyncio.wait_for(cases_, 300)  # a hang guard: make test may run this starved
        await aeng.run(check_idle)

    asyncio.run(run_batch())
    assert aeng.alive and aeng.heartbeat_age_s() < 5
