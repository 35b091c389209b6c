"""Admission's counters around the placement rule: tickets give back what
they took, calibration learns from first tokens, refusals wait for it, and
the in-flight cap is a 429."""

from __future__ import annotations

from dataclasses import replace

import time

import pytest

from pdcluster.services.backend import BackendOverloaded
from pdcluster.services.gateway import admission as admission_module
from pdcluster.services.gateway.admission import COBATCH_S, MIN_SAMPLES, Admission
from pdcluster.services.gateway.placement import DECODE, PREFILL, PlaceLoad, Rules, modelled_ttft_s
from pdcluster.planning.calibration import MAX_SLOPE, Calibration, Line, fit
from pdcluster.planning.speed import PrefillModel, StepModel

RULES = Rules(prefill=PrefillModel(0.02, 0.001), step=StepModel(0.02, 0.002), max_local_prefill_s=1.0)


def _admission(**kw) -> Admission:
    return Admission(ttft_slo_s=2.0, max_in_flight=kw.pop("max_in_flight", 1000), rules=RULES, **kw)


def _calibrate(adm: Admission, pool: str = PREFILL) -> None:
    for _ in range(MIN_SAMPLES):
        adm.places[pool].calibration.observe(0.1, 0.1)


def _past_a_first_token(adm: Admission, prefill_live: int, decode_live: int) -> None:
    """Leaves one 1-token prompt queued behind the first token of a prompt that waited: the queue is
    no fresh burst (a burst onto an idle place is admitted whole), so the prediction alone decides.
    The first token comes from a replica answering its first one: no calibration sample."""
    adm.place(1, prefill_live, decode_live)  # opens the burst, stays queued
    waited = adm.place(1, prefill_live, decode_live)
    waited.first_token(1, "a-replica-answering-its-first")


def test_sixteen_simultaneous_chats_on_an_idle_cluster_are_all_admitted_and_split():
    adm = _admission()
    _calibrate(adm)
    tickets = [adm.place(100, prefill_live=1, decode_live=1) for _ in range(16)]
    assert adm.num_shed == 0 and len(tickets) == 16
    assert adm.placed[PREFILL] > 0 and adm.placed[DECODE] > 0  # both places prefill the burst


def test_a_dead_prefill_pool_sends_everything_to_decode():
    adm = _admission()
    _calibrate(adm)
    tickets = [adm.place(n, prefill_live=0, decode_live=1) for n in (100, 600, 50)]
    assert [t.pool for t in tickets] == [DECODE, DECODE, DECODE]


def test_tickets_give_back_and_close_twice_is_harmless():
    adm = _admission()
    t1, t2 = adm.place(1500, 1, 1), adm.place(100, 1, 1)
    assert (t1.pool, t2.pool) == (PREFILL, DECODE)
    assert adm.places[PREFILL].queued_tokens == 1500 and adm.places[DECODE].queued_tokens == 100
    t1.first_token()
    t1.first_token()
    assert adm.places[PREFILL].queued_tokens == 0 and adm.places[PREFILL].num_samples == 1
    for t in (t1, t2, t1, t2):
        t.close()
    assert adm.in_flight == 0 and adm.places[DECODE].queued_requests == 0
    assert adm.places[DECODE].num_samples == 0  # closed before a first token: no sample


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _burst(adm: Admission, clock: _Clock, prompts: int, tokens: int, answer_order: list[int], spread_s: float):
    """``prompts`` of ``tokens`` admitted to the prefill pool at once, their first tokens all at
    the time the model gives the whole burst, ``spread_s`` apart, in ``answer_order``."""
    tickets = [adm.place(tokens, 1, 1) for _ in range(prompts)]
    assert {t.pool for t in tickets} == {PREFILL}
    whole = modelled_ttft_s(tokens, PlaceLoad(1, tokens * (prompts - 1)), RULES)
    for k, i in enumerate(answer_order):
        clock.now += (whole if k == 0 else spread_s)
        tickets[i].first_token()
    clock.now += 1.0
    adm.snapshot(1, 1, clock.now)  # settles the samples older than COBATCH_S
    return tickets


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 1, 0, 2]], ids=["in_order", "overtaken"])
def test_a_burst_batched_in_one_step_leaves_no_tail_margin(monkeypatch, order):
    """Four prompts prefilled as one engine step answer together: each is compared with the
    work its place served, not the queue it was admitted behind (which called the first of
    them seconds late and taught admission a tail margin that refused servable requests)."""
    clock = _Clock()
    monkeypatch.setattr(admission_module.time, "monotonic", clock)
    adm = _admission(decode_seats_per_replica=1 << 20)
    adm.rules = replace(adm.rules, max_local_prefill_s=0.0)  # no decode-side prefill
    for t in _burst(adm, clock, 4, 256, order, spread_s=COBATCH_S / 4):
        t.close()
    cal = adm.places[PREFILL].calibration
    assert cal.num_samples == 4
    # against the queue model the first answer lands 768 tokens x 1 ms = 0.77 s late
    assert cal.margin_s < 0.05 and abs(cal.line.slope - 1.0) < 0.05 and cal.line.offset_s < 0.05


def test_first_tokens_of_separate_steps_keep_their_own_work(monkeypatch):
    """Answers further apart than COBATCH_S are separate steps: a late one is late."""
    clock = _Clock()
    monkeypatch.setattr(admission_module.time, "monotonic", clock)
    adm = _admission(decode_seats_per_replica=1 << 20, shed=False)  # learns, never refuses
    adm.rules = replace(adm.rules, max_local_prefill_s=0.0)
    alone = modelled_ttft_s(256, PlaceLoad(1, 0), RULES)
    both = modelled_ttft_s(256, PlaceLoad(1, 256), RULES, joining=False)
    for _ in range(4):
        first, second = adm.place(256, 1, 1), adm.place(256, 1, 1)
        clock.now += alone
        first.first_token()
        clock.now += 3.0  # the second comes 3 s after the first: the place was slow
        second.first_token()
        clock.now += 1.0
        adm.snapshot(1, 1, clock.now)
        first.close(), second.close()
    cal = adm.places[PREFILL].calibration
    assert cal.num_samples == 8 and cal.predict(both) + cal.margin_s > both + 2.0


@pytest.mark.parametrize("cached_reported", [True, False], ids=["cached_counted", "cached_unknown"])
def test_prefix_cache_hits_calibrate_by_the_tokens_computed(monkeypatch, cached_reported):
    """Prompts answered from the prefix cache (1,024 tokens, 1,008 of them cached) are fast
    because little was computed, not because the replica is fast: taken as 1,024 computed
    tokens they pulled the line's slope to its floor, a burst of fresh prompts right after set a
    2 s tail margin, and the next prompt was refused on an idle replica (seen on a bare
    `pdcluster up`, Dec 6).  The contrast case shows the test can fail."""
    clock = _Clock()
    monkeypatch.setattr(admission_module.time, "monotonic", clock)
    adm = _admission(decode_seats_per_replica=1 << 20)
    adm.rules = replace(adm.rules, max_local_prefill_s=0.0)
    for _ in range(2):  # two rounds of 4 repeated prompts, one at a time, nearly all cached
        for _ in range(4):
            t = adm.place(1024, 1, 1)
            clock.now += modelled_ttft_s(16, PlaceLoad(1, 0), RULES, prompt_square=1024 ** 2 - 1008 ** 2)
            t.first_token(1, "", 1008 if cached_reported else 0)
            clock.now += 1.0
            t.close()
    for _ in range(4):  # then fresh 1,024-token prompts, one at a time, as the model says
        t = adm.place(1024, 1, 1)
        clock.now += modelled_ttft_s(1024, PlaceLoad(1, 0), RULES)
        t.first_token()
        clock.now += 1.0
        t.close()
    adm.snapshot(1, 1, clock.now)
    cal = adm.places[PREFILL].calibration
    assert cal.num_samples == 12
    fits = abs(cal.line.slope - 1.0) < 0.05 and cal.margin_s < 0.05
    assert fits == cached_reported, (cal.line, cal.margin_s)


def test_refusal_waits_for_measurements_then_gives_retry_after():
    adm = _admission()
    adm.place(3000, 1, 1)                       # idle: admitted however long
    second = adm.place(3000, 1, 1)              # uncalibrated: admitted, not refused on a guess
    assert second.pool == PREFILL
    _calibrate(adm)
    with pytest.raises(BackendOverloaded, match="admission.ttft_slo_s") as err:
        adm.place(3000, 1, 1)
    assert err.value.retry_after_s >= 1.0 and adm.num_shed == 1


def test_a_burst_onto_an_idle_place_is_admitted_whole_until_the_tpot_slo_seats():
    """vLLM's closed-loop client at concurrency 16 (256 in / 128 out) sends 16 prompts at once:
    the model puts the last past 0.8 x the SLO, yet nothing measured says the cluster is
    overloaded, and each refusal is re-sent at once into the same queue (on Zen 4 its 16 slots
    spent 38 of 48 prompts on 429s in 4 s while 10 were served).  A burst onto an idle place is
    admitted whole, up to the streams the decode pool runs within TPOT SLO x headroom; after the
    first token of a prompt that waited there the prediction decides again.  The burst's first
    prompt ran alone on the idle engine, often done before the burst had all arrived: its first
    token leaves the burst open (closing there refused the burst's tail in 2 runs of 15, Zen 4)."""
    adm = _admission()
    _calibrate(adm, DECODE)
    seats = adm.slo_seats(1, 1 << 30)
    assert seats == 30  # (0.08 s - 0.02 s) / 0.002 s a stream
    burst = [adm.place(256, 0, 1) for _ in range(16)]
    last = modelled_ttft_s(256, PlaceLoad(1, 15 * 256), RULES, beside_streams=15)
    assert last > RULES.ttft_slo_s and adm.num_shed == 0  # the model says late; admitted all the same
    assert 0 < adm.num_past_prediction == adm.view()["past_prediction"] < 16  # the first ones were on time
    burst[0].first_token(1, "colocated-a")  # the prompt that found the place idle
    burst.append(adm.place(256, 0, 1))  # the burst is still arriving: admitted, late as it is
    assert adm.num_shed == 0
    burst[1].first_token(1, "colocated-a")  # a prompt that waited: the queue is measured now
    with pytest.raises(BackendOverloaded, match="admission.ttft_slo_s"):
        adm.place(256, 0, 1)  # the place answered and still holds the burst's late tail
    for t in burst[2:]:
        t.first_token(1, "colocated-a")
    fresh = [adm.place(256, 0, 1) for _ in range(seats - len(burst))]  # a second burst, idle again
    assert adm.in_flight == seats and adm.num_shed == 1
    with pytest.raises(BackendOverloaded, match="admission.ttft_slo_s"):
        adm.place(256, 0, 1)  # the decode pool runs the streams its TPOT SLO keeps
    assert fresh and adm.num_shed == 2


def test_in_flight_cap_is_a_429():
    adm = _admission(max_in_flight=2)
    adm.place(1, 1, 1), adm.place(1, 1, 1)
    with pytest.raises(BackendOverloaded, match="max_in_flight"):
        adm.place(1, 1, 1)
    assert adm.num_over_capacity == 1


def test_decode_seats_bound_the_streams():
    adm = _admission(decode_seats_per_replica=2)
    adm.place(1, 1, 1), adm.place(1, 1, 1)
    with pytest.raises(BackendOverloaded, match="decode seat"):
        adm.place(1, 1, 1)
    adm.place(1, 1, 2)  # a second decode replica: room again


def test_view_keeps_the_gauges_the_metrics_read():
    adm = _admission()
    adm.place(100, 1, 1)
    view = adm.view()
    assert view["in_flight"] == 1 and view["admitted_prompt_tokens"] == 100
    assert set(view["pools"]) == {PREFILL, DECODE}
    assert sum(p["queued_tokens"] for p in view["pools"].values()) == 100


# ---- calibration ------------------------------------------------------------

def test_fit_without_samples_is_the_model():
    assert fit([]) == Line(0.0, 1.0)


def test_alike_samples_move_the_offset_not_the_slope():
    line = fit([(0.1, 0.16)] * 20)   # short prompts only: measured 60 ms over the model
    assert line.offset_s == pytest.approx(0.06, abs=0.01) and line.slope == pytest.approx(1.0, abs=0.05)


def test_spread_samples_set_the_slope():
    samples = [(x, 0.05 + 2.0 * x) for x in (0.1, 0.5, 1.0, 2.0, 4.0)] * 4  # twice as slow as modelled
    line = fit(samples)
    assert 1.9 <= line.slope <= 2.0 and line.offset_s <= 0.15  # the prior's pull (2 samples' weight) is small


def test_two_cold_outliers_set_neither_the_line_nor_the_tail():
    """The decode place's samples of one mixed_goodput run: two first tokens 3 s late right
    after start, then nine on the model (residuals ~0.02 s)."""
    c = Calibration()
    samples = [(0.111, 3.194), (0.162, 3.097), (0.153, 0.179), (0.154, 0.172), (0.177, 0.190), (0.155, 0.162),
               (0.145, 0.140), (0.158, 0.170), (0.171, 0.241), (0.154, 0.166), (0.150, 0.120)]
    for x, y in samples:
        c.observe(x, y)
    assert c.predict(0.15) < 0.25 and c.margin_s < 0.1
    plain = fit(samples)  # the plain fit and 90th percentile: offset and margin both near a second or more
    assert plain(0.15) > 0.5 and sorted(max(y - plain(x), 0.0) for x, y in samples)[int(0.9 * 11)] > 1.0


def test_a_real_tail_is_kept():
    """A tenth of the samples 1 s late, spread through the window: the margin stays about 1 s."""
    c = Calibration()
    for i in range(60):
        c.observe(0.2, 1.2 if i % 10 == 0 else 0.2)
    assert c.predict(0.2) + c.margin_s == pytest.approx(1.2, abs=0.1)


def test_calibration_bounds_and_ignores_nonsense():
    c = Calibration()
    c.observe(-1.0, 0.5)
    assert c.num_samples == 0
    for _ in range(50):
        c.observe(0.01, 100.0)
    assert c.line.slope <= MAX_SLOPE and c.predict(0.0) >= 0.0


def test_a_chat_at_a_replica_that_takes_short_prompts_first_is_predicted_and_measured_past_the_long_ones():
    """Colocated (no prefill pool): a chat admitted behind a 3k prompt is predicted one step,
    and its first token is compared with that same work, not with the 3k prompt's."""
    adm = Admission(ttft_slo_s=2.0, max_in_flight=100,
                    rules=replace(RULES, long_prefill_tokens=512, decode_step_tokens=128))
    long = adm.place(3000, 0, 1)
    chat = adm.place(100, 0, 1)
    assert long.pool == chat.pool == DECODE and adm.places[DECODE].queued_long_tokens == 3000
    beside = chat.placement.beside_streams
    alone = modelled_ttft_s(100, PlaceLoad(1, 0), adm.rules, beside_streams=beside)
    assert alone < chat.placement.modelled_ttft_s < modelled_ttft_s(100, PlaceLoad(1, 3000), adm.rules,
                                                                    beside_streams=beside) / 5
    chat.first_token()
    q = adm.places[DECODE]
    assert chat.modelled_for(q.served_tokens - chat.served_before, q.served_long_tokens - chat.served_long_before) \
        == pytest.approx(chat.placement.modelled_ttft_s)
    long.first_token()
    assert q.served_long_tokens == 3000 and q.queued_long_tokens == 0 and q.queued_tokens == 0
    long.close(), chat.close()


def _chat(adm: Admission, clock: _Clock, replica: str, wait_s: float):
    """One 100-token chat prefilled by the decode pool, answered by ``replica`` ``wait_s`` later."""
    ticket = adm.place(100, 0, 1)
    clock.now += wait_s
    ticket.first_token(1, replica)
    ticket.close()
    clock.now += 1.0
    adm.snapshot(0, 1, clock.now)  # settles it
    return ticket


@pytest.mark.parametrize("answered_by", ["decode-b", "decode-a"], ids=["a_replacement", "the_same_replica"])
def test_requests_that_waited_out_a_replica_restart_teach_admission_nothing(monkeypatch, answered_by):
    """The only replica is SIGKILLed: the requests admitted before its replacement answered
    anything (in flight at the kill, or arriving during the outage) come out 5 s late.  They
    are no samples, so no tail margin refuses the chats after the outage; the replacement's
    later first tokens are samples again.  The same 5 s answered by the replica that was
    serving all along is the place's real speed, and is learned."""
    clock = _Clock()
    monkeypatch.setattr(admission_module.time, "monotonic", clock)
    adm = _admission()
    q = adm.places[DECODE]
    _chat(adm, clock, "decode-a", 0.2)  # the replica's first answer: it waited for the replica to start
    assert (q.calibration.num_samples, q.samples_left_out) == (0, 1)
    for _ in range(6):
        _chat(adm, clock, "decode-a", 0.2)
    assert (q.calibration.num_samples, q.samples_left_out) == (6, 1)
    tail_before = q.calibration.margin_s
    backlog = [adm.place(100, 0, 1) for _ in range(8)]  # the kill, and 5 s of arrivals
    clock.now += 5.0
    for ticket in backlog:
        ticket.first_token(1, answered_by)
        ticket.close()
    clock.now += 1.0
    adm.snapshot(0, 1, clock.now)
    if answered_by == "decode-a":
        assert (q.calibration.num_samples, q.samples_left_out) == (14, 1) and q.calibration.margin_s > tail_before + 0.5
        return
    assert (q.calibration.num_samples, q.samples_left_out) == (6, 9)
    assert q.calibration.margin_s == tail_before and adm.view()["pools"][DECODE]["calibration"]["left_out"] == 9
    _chat(adm, clock, "decode-b", 0.2)  # admitted after the replacement answered: a sample
    assert (q.calibration.num_samples, q.samples_left_out) == (7, 9)


def test_without_a_replica_name_every_first_token_is_a_sample(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(admission_module.time, "monotonic", clock)
    adm = _admission()
    for _ in range(3):
        _chat(adm, clock, "", 0.2)
    assert (adm.places[DECODE].calibration.num_samples, adm.places[DECODE].samples_left_out) == (3, 0)


def test_the_queue_of_a_place_without_a_live_replica_refuses_nothing_until_its_backlog_is_answered():
    """The only (colocated) replica is SIGKILLed under load: the prompts that arrive before one
    comes back wait for a replica to start, not for the place's speed.  None is refused on that
    queue, nor while the replica that comes up still owes the backlog its first tokens; once it
    has answered them, the same queue refuses again."""
    adm = _admission()
    _calibrate(adm, DECODE)
    before = [adm.place(600, 0, 1) for _ in range(2)]  # the kill, not yet seen (the board's 5 s TTL)
    with pytest.raises(BackendOverloaded, match="admission.ttft_slo_s"):
        adm.place(600, 0, 1)  # a live replica behind this queue: refused on the prediction
    outage = [adm.place(600, 0, 0) for _ in range(8)]  # no live replica: admitted, however deep
    q = adm.places[DECODE]
    assert adm.num_shed == 1 and q.backlog_tokens == 8 * 600 and q.queued_tokens == 10 * 600
    assert adm.view()["pools"][DECODE]["backlog_tokens"] == 8 * 600
    came_back = adm.place(600, 0, 1)  # the replacement is live and owes the backlog: admitted
    for ticket in before + outage[:-1]:
        ticket.first_token(1, "colocated-b")
    assert adm.num_shed == 1 and q.backlog_tokens == 600
    outage[-1].close()  # the last of the backlog leaves before its first token
    assert q.backlog_tokens == 0
    with pytest.raises(BackendOverloaded, match="admission.ttft_slo_s"):
        for _ in range(3):  # the queue a live replica serves refuses again
            adm.place(600, 0, 1)
    came_back.close()
    assert adm.num_shed == 2


def test_the_start_up_prefill_time_replaces_the_configured_one_once_and_only_before_any_sample():
    """The replicas' start-up measurement (startup_profile.py) moves the prior: a 2.4x faster
    replica than the configured line admits the burst the line would refuse.  Only before
    the first sample (the calibration compares with the model its samples were made under),
    only once, and never where the config named its own line."""
    burst = [256] * 10
    slow, fast = _admission(adopts_measured_prefill=True), _admission(adopts_measured_prefill=True)
    assert fast.adopt_prefill(RULES.prefill.per_token_s / 2.4) and not fast.adopt_prefill(0.5)
    assert fast.rules.prefill.per_token_s == pytest.approx(RULES.prefill.per_token_s / 2.4)
    for adm in (slow, fast):
        _calibrate(adm, DECODE)
        _past_a_first_token(adm, 0, 1)
    admitted = {}
    for name, adm in (("slow", slow), ("fast", fast)):
        n = 0
        for tokens in burst:
            try:
                adm.place(tokens, 0, 1)
                n += 1
            except BackendOverloaded:
                pass
        admitted[name] = n
    assert admitted["fast"] > admitted["slow"], admitted
    late = _admission(adopts_measured_prefill=True)
    _calibrate(late, DECODE)  # a first token was measured: the prior stays
    assert not late.may_adopt_prefill and not late.adopt_prefill(0.0005)
    configured = _admission()  # the config's own line (adopts_measured_prefill False)
    assert not configured.adopt_prefill(0.0005) and configured.rules.prefill == RULES.prefill
    assert not _admission(adopts_measured_prefill=True).adopt_prefill(float("nan"))


def test_a_start_up_line_with_its_square_term_replaces_the_configured_line_whole():
    """A replica that timed a short and a long prompt publishes per_token and per_token2: admission
    takes both, and no per-step overhead (the measured per-token time holds each chunk's step).  The
    configured square term (1.7e-7 s) modelled a lone 3,072-token prompt at 2.4 s on a replica that
    prefilled it in 1.0 s: with the measured line a 3k prompt behind a short one is admitted."""
    squared = replace(RULES, prefill=PrefillModel(0.02, 0.001, 1.7e-7))  # the configured default's square term
    measured = Admission(ttft_slo_s=2.0, max_in_flight=1000, rules=squared, adopts_measured_prefill=True)
    assert measured.adopt_prefill(0.00021, 4e-8)
    assert (measured.rules.prefill.per_token_s, measured.rules.prefill.per_token2_s,
            measured.rules.prefill.overhead_s) == (0.00021, 4e-8, 0.0)
    assert measured.rules.prefill.time_s(3072) == pytest.approx(0.00021 * 3072 + 4e-8 * 3072 ** 2)
    configured = Admission(ttft_slo_s=2.0, max_in_flight=1000, rules=squared, adopts_measured_prefill=True)
    assert configured.adopt_prefill(0.00021, float("inf"))  # a nonsense square term: only the per-token time
    assert configured.rules.prefill.per_token2_s == 1.7e-7
    for adm in (measured, configured):
        _calibrate(adm, DECODE)
        _past_a_first_token(adm, 0, 1)
        adm.place(200, 0, 1)  # queued work, so a prediction may refuse
    measured.place(3072, 0, 1)
    with pytest.raises(BackendOverloaded):
        configured.place(3072, 0, 1)


def test_the_start_up_step_line_replaces_the_configured_one_once_and_only_before_any_sample():
    """The decode replicas' start-up step line (startup_profile.measure_step) replaces the configured
    one: a step three times faster than configured runs more streams within the TPOT bound.  Only
    before the first TTFT or TPOT sample, once, with a sane line, and never where the config named
    its own line (adopts_measured_step False)."""
    slow = RULES.step
    fast = _admission(adopts_measured_step=True)
    assert fast.may_adopt_step
    assert not fast.adopt_step((2.0, 0.001)) and not fast.adopt_step((0.01, float("nan")))
    assert not fast.adopt_step(None) and fast.rules.step == slow
    assert fast.adopt_step((slow.base_s / 3, slow.per_seq_s / 3))
    assert fast.rules.step.base_s == pytest.approx(slow.base_s / 3) and fast.rules.step.source == "measured at start-up"
    assert not fast.may_adopt_step and not fast.adopt_step((0.001, 0.0001))  # once
    assert fast.slo_seats(1, 1 << 30) > _admission().slo_seats(1, 1 << 30)
    assert "measured at start-up" in fast.view()["step_model"]
    late = _admission(adopts_measured_step=True)
    _calibrate(late, DECODE)  # a first token was measured: the prior stays
    assert not late.may_adopt_step and not late.adopt_step((0.005, 0.0005))
    after_tpot = _admission(adopts_measured_step=True)
    after_tpot.tpot.observe(0.05, 0.05)
    assert not after_tpot.adopt_step((0.005, 0.0005))
    configured = _admission()
    assert not configured.adopt_step((0.005, 0.0005)) and configured.rules.step == slow


def test_the_queue_counts_its_prompts_squares_and_gives_them_back():
    adm = _admission()
    first = adm.place(3000, 0, 1)
    second = adm.place(100, 0, 1)
    load = adm.snapshot(0, 1, time.monotonic()).decode
    assert (load.queued_tokens, load.queued_square_tokens) == (3100, 3000.0 ** 2 + 100.0 ** 2)
    first.first_token()
    second.close()
    load = adm.snapshot(0, 1, time.monotonic()).decode
    assert (load.queued_tokens, load.queued_square_tokens) == (0, 0.0)
    assert adm.places[DECODE].served_square == 3000.0 ** 2  # the one answered with a first token


def test_a_cached_estimate_queues_its_work_and_the_first_token_says_what_was_computed():
    adm = _admission()
    chat = adm.place(2000, 1, 1, cached={PREFILL: 1984})
    assert chat.pool == PREFILL and adm.places[PREFILL].queued_tokens == 16
    other = adm.place(2000, 1, 1)
    assert adm.places[PREFILL].queued_tokens == 16 + 2000
    chat.first_token(1, "", cached_tokens=0)  # the replica had evicted it: computed whole
    other.first_token(1, "", cached_tokens=1000)
    q = adm.places[PREFILL]
    assert q.queued_tokens == 0 and q.queued_requests == 0
    assert q.served_tokens == 2000 + 1000
    for t in (chat, other):
        t.close()
    assert adm.in_flight == 0
