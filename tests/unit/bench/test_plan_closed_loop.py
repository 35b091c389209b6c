"""The closed loop as the engines schedule it (bench/plan/closed_loop.py):
exact timings on tiny cases, table-driven, with constant speeds so every
expected figure is arithmetic a reader can redo."""

from __future__ import annotations

import pytest

from bench.plan.closed_loop import EngineLimits, Speeds, Workload, simulate

OVERHEAD, PER_TOKEN, STEP, HANDOFF = 0.1, 0.01, 0.05, 0.02


def busy(n: int) -> float:
    return PER_TOKEN * n


def speeds(**kw) -> Speeds:
    return Speeds(**({"overhead_s": OVERHEAD, "prefill_busy_s": busy, "decode_step_s": lambda b, ctx: STEP,
                      "handoff_s": HANDOFF} | kw))


@pytest.mark.parametrize("clients, prompt, limits, ttfts", [
    # one request: overhead, then its own step
    (1, 50, EngineLimits(), [OVERHEAD + busy(50)]),
    # sent together, they reach the engine one by one: the first steps alone, the second waits for it
    (2, 50, EngineLimits(), [OVERHEAD + busy(50), OVERHEAD + 2 * busy(50)]),
    # the two that waited during the first step share the next one
    (3, 50, EngineLimits(), [OVERHEAD + busy(50)] + [OVERHEAD + busy(50) + busy(100)] * 2),
    # the token budget: the third prompt gets 36 tokens in step two and the rest in step three
    (3, 64, EngineLimits(max_num_batched_tokens=100), [OVERHEAD + busy(64), OVERHEAD + busy(64) + busy(100),
                                                       OVERHEAD + busy(64) + busy(100) + busy(28)]),
    # chunked prefill: 1200 tokens in chunks of 512
    (1, 1200, EngineLimits(), [OVERHEAD + 2 * busy(512) + busy(176)]),
])
def test_first_round_ttft_follows_the_prefill_schedule(clients, prompt, limits, ttfts):
    timings = simulate(speeds(), Workload(clients, 1, prompt, 4), limits)
    assert [t.ttft_s for t in timings] == pytest.approx(ttfts)


def test_one_client_decodes_alone_after_the_handoff():
    (t,) = simulate(speeds(), Workload(1, 1, 50, 11))
    assert t.ttft_s == pytest.approx(OVERHEAD + busy(50))
    assert t.e2e_s == pytest.approx(OVERHEAD + busy(50) + HANDOFF + 10 * STEP)
    assert t.tpot_s == pytest.approx((HANDOFF + 10 * STEP) / 10)


def test_each_client_sends_its_next_request_when_the_last_ends():
    timings = simulate(speeds(), Workload(2, 3, 50, 5))
    assert len(timings) == 6
    for client in (0, 1):
        mine = [t for t in timings if t.client == client]
        for before, after in zip(mine, mine[1:]):
            assert after.send_s == pytest.approx(before.send_s + before.e2e_s)


def test_decode_steps_carry_every_joined_sequence_at_the_step_time_of_their_batch_and_context():
    seen = []

    def step(batch: int, context: float) -> float:
        seen.append((batch, context))
        return 0.0625

    simulate(speeds(prefill_busy_s=lambda n: 0.125, decode_step_s=step, overhead_s=0.0, handoff_s=0.0),
             Workload(2, 1, 10, 5))
    # A: prefill to 0.125, decode steps from 0.125 (context 10, 11, 12, 13); B: prefill to 0.25, joins
    # then, as A's step from 0.25 has just started: B's first step is A's last, at batch 2
    assert seen == [(1, 10), (1, 11), (1, 12), (2, 11.5), (1, 11), (1, 12), (1, 13)]


@pytest.mark.parametrize("decode_slowdown, prefill_slowdown, slower", [
    (1.0, 1.0, "none"), (2.0, 1.0, "decode"), (1.0, 2.0, "prefill"),
])
def test_a_step_started_while_the_other_replica_computes_is_slowed(decode_slowdown, prefill_slowdown, slower):
    """Two clients with long prompts: the first decodes while the second prefills."""
    base = simulate(speeds(), Workload(2, 1, 100, 21))
    slowed = simulate(speeds(decode_slowdown=decode_slowdown, prefill_slowdown=prefill_slowdown),
                      Workload(2, 1, 100, 21))
    first_tpot = (slowed[0].tpot_s > base[0].tpot_s + 1e-12)
    assert first_tpot == (slower == "decode")
    assert slowed[0].ttft_s == pytest.approx(base[0].ttft_s)  # nothing else ran during the first prefill
    if slower == "none":
        assert [t.e2e_s for t in slowed] == pytest.approx([t.e2e_s for t in base])


def test_prefill_runs_slower_while_decoding_and_at_its_own_pace_otherwise():
    """Prefill 1 s of work per prompt, pace 1.5 while decoding.  A: prefill 0.1-1.1 s alone (TTFT 1.1), decodes
    1.12-3.12 s.  B: prefill from 1.1 s, 0.02 s alone, then 0.98 s of work at pace 1.5 -> ends 2.59 s; decodes
    2.62-4.62 s.  A's second (sent 3.12 s) prefills from 3.22 s beside B's decoding: 1.4 s does 0.933 s of work,
    the last 0.067 s runs alone -> TTFT 0.1 + 1.4 + 0.067."""
    base = simulate(speeds(), Workload(2, 2, 100, 41))
    slowed = simulate(speeds(prefill_slowdown=1.5), Workload(2, 2, 100, 41))
    assert [t.ttft_s for t in base[:3]] == pytest.approx([OVERHEAD + busy(100), OVERHEAD + 2 * busy(100),
                                                          OVERHEAD + busy(100)])
    assert [t.ttft_s for t in slowed[:3]] == pytest.approx([1.1, 1.1 + 0.02 + 0.98 * 1.5,
                                                            OVERHEAD + 1.4 + (1 - 1.4 / 1.5)])


def test_a_request_sent_while_decoding_arrives_its_delay_later():
    """Two clients, prompts of 0.1 s: the first two requests are sent with nothing decoding (no delay); A's
    second is sent at 1.22 s, when A's first ends and B's still decodes: it arrives 0.05 s later; B's second,
    sent at 1.37 s, finds no sequence decoding (A's second is in prefill): no delay."""
    base = simulate(speeds(), Workload(2, 2, 10, 21))
    delayed = simulate(speeds(prefill_delay_s=0.05), Workload(2, 2, 10, 21))
    assert [t.ttft_s for t in base] == pytest.approx([0.2, 0.3, 0.2, 0.2])
    assert [t.ttft_s for t in delayed] == pytest.approx([0.2, 0.3, 0.25, 0.2])


def test_the_same_inputs_give_the_same_timings():
    a = simulate(speeds(), Workload(3, 4, 64, 48))
    b = simulate(speeds(), Workload(3, 4, 64, 48))
    assert a == b and len(a) == 12


@pytest.mark.parametrize("make", [
    lambda: Workload(0, 1, 10, 10), lambda: Workload(1, 1, 0, 10), lambda: EngineLimits(prefill_chunk_size=0),
    lambda: speeds(decode_slowdown=0.5), lambda: speeds(overhead_s=-1.0), lambda: speeds(prefill_delay_s=-0.1),
])
def test_bad_inputs_are_refused(make):
    with pytest.raises(ValueError):
        make()
