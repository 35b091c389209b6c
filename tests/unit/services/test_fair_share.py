"""Fair shares at admission (services/gateway/fair_share.py): the work a new
request waits behind, the last decode seats, and Admission refusing a
tenant's flood while admitting the others' requests."""

from __future__ import annotations

import pytest

from services.backend import BackendOverloaded
from services.gateway.admission import MIN_SAMPLES, Admission
from services.gateway.fair_share import may_take_seat, seat_reserve, tokens_ahead
from services.gateway.placement import PREFILL, Rules
from services.speed.model import PrefillModel, StepModel


@pytest.mark.parametrize("queued, tenant, priority, prompt, weights, ahead", [
    ({}, "B", 0, 100, {}, 0),
    # A's flood of 5000 tokens: B waits behind its own 0 + min(5000, 0 + 100) of A's
    ({(0, "A"): 5000}, "B", 0, 100, {}, 100),
    # A itself waits behind all of its own
    ({(0, "A"): 5000}, "A", 0, 100, {}, 5000),
    # a more urgent class is always ahead; a less urgent one never
    ({(-1, "C"): 300, (0, "A"): 5000, (5, "D"): 900}, "B", 0, 100, {}, 400),
    # C at the urgent priority waits behind nothing of priority 0
    ({(0, "A"): 5000, (0, "B"): 100}, "C", -1, 50, {}, 0),
    # weights: A at weight 3 is served 3 tokens per B token
    ({(0, "A"): 5000}, "B", 0, 100, {"A": 3.0}, 300),
    ({(0, "A"): 5000, (0, "B"): 200}, "B", 0, 100, {}, 500),
])
def test_tokens_ahead_table(queued, tenant, priority, prompt, weights, ahead):
    assert tokens_ahead(queued, tenant, priority, prompt, weights) == ahead


@pytest.mark.parametrize("streams, tenant, seats, weights, ok", [
    ({}, "A", 16, {}, True),
    ({"A": 15}, "A", 16, {}, True),          # one tenant: its share is every seat
    ({"A": 16}, "A", 16, {}, False),         # none left
    ({"A": 14}, "A", 16, {}, True),
    ({"A": 14}, "B", 16, {}, True),          # B below its share takes one of the last
    ({"A": 13, "B": 1}, "A", 16, {}, False), # A over half, 2 left (the reserve): refused
    ({"A": 8, "B": 1}, "A", 16, {}, True),   # 7 free: more than the reserve
    ({"A": 10, "B": 4}, "A", 16, {"A": 4.0}, True),  # A's share at weight 4 is 12.8 seats
])
def test_seat_table(streams, tenant, seats, weights, ok):
    assert may_take_seat(streams, tenant, seats, weights) is ok


def test_the_reserve_is_an_eighth_and_at_least_one():
    assert (seat_reserve(1), seat_reserve(16), seat_reserve(200)) == (1, 2, 25)


RULES = Rules(prefill=PrefillModel(0.02, 0.001), step=StepModel(0.02, 0.002), max_local_prefill_s=0.0)


def _calibrated(**kw) -> Admission:
    adm = Admission(ttft_slo_s=2.0, max_in_flight=1000, rules=RULES, **kw)
    for _ in range(MIN_SAMPLES):
        adm.places[PREFILL].calibration.observe(0.1, 0.1)
    return adm


def test_a_flood_is_refused_its_excess_while_another_tenant_is_admitted():
    adm = _calibrated()
    admitted = []
    with pytest.raises(BackendOverloaded):
        for _ in range(100):
            admitted.append(adm.place(500, prefill_live=1, decode_live=1, tenant="A"))
    assert 0 < len(admitted) < 100
    b = adm.place(500, prefill_live=1, decode_live=1, tenant="B")
    assert b.pool == PREFILL and b.placement.predicted_ttft_s < 2.0
    assert adm.places[PREFILL].by_class == {(0, "A"): 500 * len(admitted), (0, "B"): 500}
    for t in admitted + [b]:
        t.close()
    assert adm.places[PREFILL].by_class == {} and adm.streams_of == {} and adm.in_flight == 0


def test_one_tenant_sees_the_whole_queue_as_before():
    adm = _calibrated()
    for _ in range(3):
        adm.place(500, prefill_live=1, decode_live=1)
    assert adm.snapshot(1, 1, 0.0).prefill.queued_tokens == 1500
    assert adm.snapshot(1, 1, 0.0, who=(0, "default"), prompt_tokens=10).prefill.queued_tokens == 1500


def test_the_last_seats_go_to_a_tenant_below_its_share():
    adm = Admission(ttft_slo_s=2.0, max_in_flight=1000, shed=False, rules=RULES, decode_seats_per_replica=16)
    b = [adm.place(10, prefill_live=1, decode_live=1, tenant="B")]
    flood = []
    with pytest.raises(BackendOverloaded, match="fair share"):
        for _ in range(16):
            flood.append(adm.place(10, prefill_live=1, decode_live=1, tenant="A"))
    assert len(flood) == 16 - 1 - seat_reserve(16)
    b += [adm.place(10, prefill_live=1, decode_live=1, tenant="B") for _ in range(seat_reserve(16))]
    assert adm.in_flight == 16 and adm.num_seat_shares == 1
