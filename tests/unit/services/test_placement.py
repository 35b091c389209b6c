"""The admission and placement rule (pdcluster/services/gateway/placement.py) as a
table: the cases issue 32 found refused on an idle cluster, and the ones
that must still be refused or kept off the decode replica."""

from __future__ import annotations

import pytest

from pdcluster.services.gateway.placement import (DECODE, PREFILL, PlaceLoad, Rules, Snapshot, decode_keeps_tpot,
                                        modelled_ttft_s, place)
from pdcluster.planning.speed import PrefillModel, StepModel

# Round figures: 1 ms per prompt token, 20 ms per step, no attention term; a 20 ms + 2 ms/seq decode step.
RULES = Rules(prefill=PrefillModel(0.02, 0.001), step=StepModel(0.02, 0.002), ttft_slo_s=2.0, tpot_slo_s=0.1,
              headroom=0.8, batch_tokens=1024, window_s=10.0, max_local_prefill_s=1.0)


def snap(prefill=(1, 0, 0), decode=(1, 0, 0), streams=0, seats=1 << 30, busy_s=0.0, calibrated=True,
         fresh_burst=False, slo_seats=0):
    """(live replicas, queued tokens, queued requests) per place; prefill None: no live prefill replica;
    ``fresh_burst``: both places' queues arrived after they were idle, before a first token."""
    def load(live, tokens, requests):
        return PlaceLoad(live, tokens, requests, fresh_burst=fresh_burst)
    return Snapshot(prefill=None if prefill is None else load(*prefill), decode=load(*decode),
                    decode_streams=streams, decode_seats=seats, decode_busy_s=busy_s, calibrated=calibrated,
                    slo_seats=slo_seats)


@pytest.mark.parametrize("case, prompt, snapshot, pool, reason", [
    # Issue 32's refusals on an idle-looking cluster: every one is served now.
    ("idle cluster, short chat: a tie goes to the prefill pool", 100, snap(), PREFILL, "prefill_pool"),
    ("16th of 16 simultaneous chats (15 queued, split)", 100,
     snap(prefill=(1, 1100, 11), decode=(1, 400, 4), streams=15), DECODE, "earlier_on_decode"),
    ("8th of 8 simultaneous 200-token streams", 20,
     snap(prefill=(1, 60, 3), decode=(1, 80, 4), streams=7), PREFILL, "prefill_pool"),
    ("prefill pool dead (SIGKILL)", 100, snap(prefill=None, decode=(1, 300, 3), streams=10), DECODE,
     "no_prefill_replica"),
    ("prefill pool dead, long prompt over the local bound", 3000, snap(prefill=None), DECODE,
     "no_prefill_replica"),
    # Long prompts stay off the decode replica while a prefill replica lives.
    ("long input, idle cluster", 1500, snap(), PREFILL, "prefill_pool"),
    ("short chat while the prefill pool runs a 3k burst", 100, snap(prefill=(1, 3000, 1), streams=5), DECODE,
     "earlier_on_decode"),
    ("idle prefill pool beats a decode replica with queued prompts", 100,
     snap(prefill=(1, 0, 0), decode=(1, 400, 4), streams=4), PREFILL, "prefill_pool"),
    # The decode replica's streams keep their TPOT: it is too busy, the prefill pool takes it.
    ("decode replica at its TPOT limit", 100, snap(prefill=(1, 200, 2), streams=30), PREFILL, "prefill_pool"),
    ("decode replica busy prefilling", 100, snap(prefill=(1, 200, 2), busy_s=7.5), PREFILL, "prefill_pool"),
    # The SLO still holds: an idle place admits anything; a queue that breaks it is refused.
    ("3k prompt alone breaks the SLO but its place is idle", 3000, snap(), PREFILL, "prefill_pool"),
    ("second 3k prompt of a burst", 3000, snap(prefill=(1, 3000, 1), streams=1), None, None),
    # A burst onto an idle place is served whole while the decode pool keeps its TPOT: nothing
    # measured says the cluster is overloaded (a closed-loop client's first 16 prompts).
    ("7th of 8 simultaneous 250-token prompts on a colocated replica", 250,
     snap(prefill=None, decode=(1, 1500, 6), streams=6, fresh_burst=True, slo_seats=30), DECODE,
     "no_prefill_replica"),
    ("9th of 16 simultaneous 256-token prompts on one colocated replica", 256,
     snap(prefill=None, decode=(1, 2048, 8), streams=8, fresh_burst=True, slo_seats=30), DECODE,
     "no_prefill_replica"),
    ("a fresh burst past the streams the TPOT SLO keeps", 250,
     snap(prefill=None, decode=(1, 1500, 6), streams=30, fresh_burst=True, slo_seats=30), None, None),
    ("a long prompt of a fresh burst: late, it costs the streams beside it their TPOT", 3000,
     snap(prefill=(1, 3000, 1), streams=1, fresh_burst=True, slo_seats=30), None, None),
    ("uncalibrated: no refusal on a guess", 3000, snap(prefill=(1, 3000, 1), streams=1, calibrated=False),
     PREFILL, "prefill_pool"),
    ("two prefill replicas halve the queue", 1200, snap(prefill=(2, 1600, 2), streams=2), PREFILL,
     "prefill_pool"),
    ("every decode seat taken", 10, snap(streams=128, seats=128), None, None),
])
def test_placement_table(case, prompt, snapshot, pool, reason):
    p = place(prompt, snapshot, RULES)
    assert p.pool == pool, (case, p)
    if pool is None:
        assert p.retry_after_s >= 1.0 and p.reason, case
    else:
        assert p.reason == reason, (case, p)
        assert p.predicted_ttft_s > 0, case
        # every admitted burst row is predicted late: admitted past the prediction, and counted so
        assert p.past_prediction == snapshot.decode.fresh_burst, case


def test_the_tail_margin_counts_toward_the_refusal():
    near = snap(prefill=(1, 1000, 1), streams=30)           # 1.54 s predicted: under 1.6 s (decode too busy)
    assert place(500, near, RULES).pool == PREFILL
    tailed = snap(prefill=(1, 1000, 1), streams=30)
    tailed = Snapshot(**{**tailed.__dict__, "prefill": PlaceLoad(1, 1000, 1, tail_s=0.3)})
    assert place(500, tailed, RULES).pool is None           # its slowest 20th lands at 1.84 s


def test_a_refusal_names_the_slo_and_the_excess():
    p = place(3000, snap(prefill=(1, 6000, 2), streams=2), RULES)
    # 9000 tokens behind one replica: 9 steps x 20 ms + 9 s = 9.18 s; 7.58 s over 0.8 x 2 s
    assert p.pool is None and p.predicted_ttft_s == pytest.approx(9.18)
    assert p.retry_after_s == 8.0
    assert "admission.ttft_slo_s" in p.reason and "6000 queued" in p.reason


def test_shedding_off_admits_everything_but_seats():
    rules = Rules(prefill=RULES.prefill, step=RULES.step, shed=False)
    assert place(3000, snap(prefill=(1, 90_000, 30)), rules).pool == PREFILL
    assert place(1, snap(streams=5, seats=5), rules).pool is None


def test_modelled_ttft_batches_the_queue_into_steps():
    # 1600 queued chat tokens + 100: two 1024-token steps, not 17 per-request overheads.
    assert modelled_ttft_s(100, PlaceLoad(1, 1600, 16), RULES) == pytest.approx(2 * 0.02 + 1.7)
    # beside 10 decoding streams, each step also runs their 10 rows (10 x 2 ms), not a decode step of
    # their own: the step streams the weights once for the prompt's rows and theirs
    assert modelled_ttft_s(100, PlaceLoad(1, 0, 0), RULES, beside_streams=10) == pytest.approx(0.02 + 0.02 + 0.1)


@pytest.mark.parametrize("queued, arriving, expected_tokens", [
    (0, 0.0, 100),          # nothing arriving: its step holds its own prompt only
    (0, 400.0, 100 + 400 * 1.044),  # 400 tok/s for one full step (20 ms + 1024 x 1 ms): 418 join it
    (0, 1e6, 1024),         # a flood fills its step, no more
    (1000, 1e6, 1100 + 948),  # behind a full step: its own step (the second) fills up too
])
def test_prompts_arriving_join_its_last_step(queued, arriving, expected_tokens):
    """An engine step answers every prompt it holds at its end, so the prompts that arrive before
    its last step starts delay its first token: under load that step is full."""
    load = PlaceLoad(1, queued, 1, arriving_tokens_per_s=arriving)
    steps = -(-expected_tokens // 1024)
    assert modelled_ttft_s(100, load, RULES) == pytest.approx(steps * 0.02 + expected_tokens * 0.001)
    assert modelled_ttft_s(100, load, RULES, joining=False) == pytest.approx(-(-(queued + 100) // 1024) * 0.02
                                                                             + (queued + 100) * 0.001)


def test_calibration_is_applied_to_each_place():
    slow_prefill = PlaceLoad(1, 0, 0, calibrated=lambda s: 10 * s)  # measured 10x the model
    p = place(400, Snapshot(prefill=slow_prefill, decode=PlaceLoad(1)), RULES)
    assert p.pool == DECODE  # 0.42 s there against 4.2 s in the prefill pool


@pytest.mark.parametrize("streams, busy_s, prompt, keeps", [
    (0, 0.0, 100, True),
    (30, 0.0, 100, False),     # step(31) = 82 ms > 80 ms
    (10, 6.0, 100, False),     # 61% busy: 42 ms / 0.39 = 108 ms
    (10, 0.0, 1200, False),    # 1.2 s of prefill there > 1 s bound
])
def test_decode_keeps_tpot(streams, busy_s, prompt, keeps):
    assert decode_keeps_tpot(prompt, snap(streams=streams, busy_s=busy_s), RULES)[0] is keeps


SHORT_FIRST = Rules(prefill=PrefillModel(0.02, 0.001), step=StepModel(0.02, 0.002), decode_step_tokens=128,
                    long_prefill_tokens=512)


@pytest.mark.parametrize("prompt, queued, longs, expected_tokens", [
    (100, 3000, 3000, 128),    # a chat behind a 3k prompt: one step, filled by a long chunk
    (100, 3200, 3000, 384),    # ... behind 200 tokens of other chats too: 300 tokens, three full steps
    (100, 200, 0, 300),        # no long prompt queued: only what is there
    (600, 3000, 3000, 3600),   # a long prompt waits for the long ones ahead: arrival order among them
])
def test_short_prompts_leave_out_the_long_ones_queued_at_a_decoding_replica(prompt, queued, longs,
                                                                            expected_tokens):
    load = PlaceLoad(1, queued, 1, queued_long_tokens=longs)
    got = modelled_ttft_s(prompt, load, SHORT_FIRST, beside_streams=2, joining=False)
    steps = -(-expected_tokens // 128)
    assert got == pytest.approx(steps * (0.02 + SHORT_FIRST.step.rows_s(2)) + 0.001 * expected_tokens)


def test_a_prefill_replica_keeps_arrival_order():
    load = PlaceLoad(1, 3000, 1, queued_long_tokens=3000)
    assert modelled_ttft_s(100, load, SHORT_FIRST, joining=False) == \
        modelled_ttft_s(100, PlaceLoad(1, 3000, 1), SHORT_FIRST, joining=False)


def test_the_queued_prompts_attention_counts_with_their_tokens():
    """Attention grows with each prompt's square: a 3,000-token prompt behind another one waits for
    that one's square term too, not only for its tokens (per_token2 x 3000^2 = 0.36 s here)."""
    rules = Rules(prefill=PrefillModel(0.0, 0.00024, 4e-8), step=StepModel(0.012, 0.0003))
    alone = modelled_ttft_s(3000, PlaceLoad(1, 3000, 1), rules)
    behind = modelled_ttft_s(3000, PlaceLoad(1, 3000, 1, queued_square_tokens=3000.0 ** 2), rules)
    assert behind - alone == pytest.approx(4e-8 * 3000 ** 2)
    halves = modelled_ttft_s(3000, PlaceLoad(2, 3000, 1, queued_square_tokens=3000.0 ** 2), rules)
    assert halves < behind  # two replicas share the queue: half of its squares each
    # a short prompt at a place that takes short ones first waits for no long prompt's square
    short_first = Rules(prefill=rules.prefill, step=rules.step, long_prefill_tokens=512)
    load = PlaceLoad(1, 3100, 2, queued_long_tokens=3000, queued_square_tokens=3000.0 ** 2 + 100.0 ** 2,
                     queued_long_square_tokens=3000.0 ** 2)
    base = PlaceLoad(1, 3100, 2, queued_long_tokens=3000, queued_square_tokens=100.0 ** 2,
                     queued_long_square_tokens=0.0)
    assert modelled_ttft_s(100, load, short_first, beside_streams=1) == pytest.approx(
        modelled_ttft_s(100, base, short_first, beside_streams=1))


@pytest.mark.parametrize("case, prompt, snapshot, cached, pool", [
    # A chat's next turn resends a 2,000-token history its replica still holds: the turn computes
    # its new message.  Counted whole, the third of three such turns was refused.
    ("third chat turn, history cached on the prefill pool", 2000, snap(prefill=(1, 200, 2), streams=2),
     {PREFILL: 1984}, PREFILL),
    ("the same turn, nothing cached: refused", 2000, snap(prefill=(1, 4000, 2), streams=2), {}, None),
    ("colocated: the history cached on the colocated pool", 2000, snap(prefill=None, decode=(1, 200, 2), streams=2),
     {DECODE: 1984}, DECODE),
    ("cached on the decode pool: a decode-side prefill computes 16 tokens", 2000,
     snap(prefill=(1, 4000, 2), streams=2), {DECODE: 1984}, DECODE),
    # 1 prefill + 1 decode: the prefill replica holds the history up to the last reply, the decode
    # replica the history and the reply it generated (cached_prefix.py counts it now).
    ("1p1d chat turn: the decode replica holds the reply too, an idle prefill pool", 2000,
     snap(prefill=(1, 0, 0), streams=2), {PREFILL: 1904, DECODE: 1984}, DECODE),
    ("the same turn with the decode replica's match unknown", 2000,
     snap(prefill=(1, 0, 0), streams=2), {PREFILL: 1904}, PREFILL),
])
def test_a_cached_prefix_is_no_work(case, prompt, snapshot, cached, pool):
    p = place(prompt, snapshot, RULES, cached)
    assert p.pool == pool, (case, p)
    if pool is not None:
        assert p.computed_tokens == prompt - cached[pool], case
        assert p.predicted_ttft_s < 0.5, (case, p)


def test_a_fully_cached_prompt_still_computes_one_token():
    p = place(64, snap(), RULES, {PREFILL: 64})
    assert p.computed_tokens == 1
