"""Fair shares at admission (pdcluster/services/gateway/fair_share.py): the work a new
request waits behind, the last decode seats, and Admission refusing a
tenant's flood while admitting the others' requests."""

from __future__ import annotations

import pytest

from pdcluster.services.backend import BackendOverloaded
from pdcluster.services.gateway.admission import MIN_SAMPLES, Admission
from pdcluster.services.gateway.fair_share import may_take_seat, tokens_ahead
from pdcluster.services.gateway.placement import PREFILL, Rules
from pdcluster.planning.speed import PrefillModel, StepModel


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


@pytest.mark.parametrize("streams, tenant, seats, slo, active, ok", [
    ({}, "A", 16, 8, (), True),
    ({"A": 15}, "A", 16, 8, (), True),            # alone: every seat, past the SLO's 8 (late, not refused)
    ({"A": 16}, "A", 16, 8, (), False),           # none left
    ({"A": 5}, "A", 16, 8, ("B",), True),          # B active, below its share: 8 - 1 kept = 7 for anyone
    ({"A": 7}, "A", 16, 8, ("B",), False),         # ... the 8th is B's; A holds 7 >= its share 4
    ({"A": 7}, "B", 16, 8, ("A",), True),          # B takes it
    ({"A": 7, "B": 1}, "B", 16, 8, (), True),       # B below its share 4 even past the SLO's 8
    ({"A": 3, "B": 5}, "A", 16, 8, (), True),       # A below its share, B over: A takes the 9th
    ({"A": 6, "B": 1, "C": 0}, "A", 16, 8, ("C",), False),  # C kept one, B one: A (over 8/3) waits
    ({"A": 6, "B": 1}, "A", 16, 12, ("C",), True),  # a larger SLO budget: 12 - 2 kept > 7 taken
])
def test_seat_table(streams, tenant, seats, slo, active, ok):
    assert may_take_seat(streams, tenant, seats, {}, slo, active) is ok


def test_weights_set_the_shares():
    # A at weight 3 of 4: share 6 of 8 (B active, below its share: one kept)
    assert may_take_seat({"A": 5}, "A", 16, {"A": 3.0}, 8, ("B",)) is True
    assert may_take_seat({"A": 7}, "A", 16, {"A": 3.0}, 8, ("B",)) is False
    assert may_take_seat({"A": 6, "B": 1}, "B", 16, {"A": 3.0}, 8, ()) is True    # B's share: 2 of 8
    assert may_take_seat({"A": 6, "B": 2}, "B", 16, {"A": 3.0}, 8, ()) is False


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
        adm.place(400, prefill_live=1, decode_live=1)
    assert adm.snapshot(1, 1, 0.0).prefill.queued_tokens == 1200
    assert adm.snapshot(1, 1, 0.0, who=(0, "default"), prompt_tokens=10).prefill.queued_tokens == 1200


def test_a_flood_is_kept_within_the_tpot_budget_while_another_tenant_is_active():
    """The step model gives 8 streams within the 0.1 s TPOT x 0.8 (10 ms + 8.75 ms each: 8); A floods
    while B holds one: A stops at 6 (one more seat kept for B's next request), which B then takes."""
    rules = Rules(prefill=PrefillModel(0.02, 0.001), step=StepModel(0.01, 0.00875), max_local_prefill_s=0.0)
    adm = Admission(ttft_slo_s=2.0, max_in_flight=1000, rules=rules, decode_seats_per_replica=64)
    for _ in range(MIN_SAMPLES):                    # TPOTs measured as the step model has them
        adm.tpot.observe(0.05, 0.05)
    assert adm.slo_seats(1, 64) == 8
    b = [adm.place(10, prefill_live=1, decode_live=1, tenant="B")]
    flood = []
    with pytest.raises(BackendOverloaded, match="fair share"):
        for _ in range(64):
            flood.append(adm.place(10, prefill_live=1, decode_live=1, tenant="A"))
    assert len(flood) == 8 - 1 - 1
    b.append(adm.place(10, prefill_live=1, decode_live=1, tenant="B"))  # below its share of 4
    assert adm.in_flight == 8 and adm.num_seat_shares == 1
    for t in flood + b:
        t.close()
    solo = []
    with pytest.raises(BackendOverloaded, match="fair share"):
        for _ in range(20):  # A and B asked within 30 s: one seat kept for each
            solo.append(adm.place(10, prefill_live=1, decode_live=1, tenant="solo"))
    assert len(solo) == 8 - 2


def test_without_shedding_no_seat_is_refused_on_the_tpot_budget():
    rules = Rules(prefill=PrefillModel(0.02, 0.001), step=StepModel(0.01, 0.00875), max_local_prefill_s=0.0)
    adm = Admission(ttft_slo_s=2.0, max_in_flight=1000, shed=False, rules=rules, decode_seats_per_replica=64)
    adm.place(10, prefill_live=1, decode_live=1, tenant="B")
    flood = [adm.place(10, prefill_live=1, decode_live=1, tenant="A") for _ in range(40)]
    assert len(flood) == 40 and adm.num_seat_shares == 0


def test_no_seat_is_refused_before_tpots_were_measured():
    rules = Rules(prefill=PrefillModel(0.02, 0.001), step=StepModel(0.01, 0.00875), max_local_prefill_s=0.0)
    adm = Admission(ttft_slo_s=2.0, max_in_flight=1000, rules=rules, decode_seats_per_replica=64)
    adm.place(10, prefill_live=1, decode_live=1, tenant="B")
    flood = [adm.place(10, prefill_live=1, decode_live=1, tenant="A") for _ in range(40)]
    assert len(flood) == 40 and adm.num_seat_shares == 0


def test_a_tenant_weight_is_bounded():
    from pdcluster.services.config import ClusterConfig
    for bad in (0, -1, 5e-324, 1e9, float("nan")):
        with pytest.raises(ValueError):
            ClusterConfig(tenants=[{"name": "t", "weight": bad}])
