"""Load shedding: the pure rule, the busy-time rate, and the tickets."""

from __future__ import annotations

import pytest

from services.gateway.admission import MIN_SAMPLES, REQUEST_OVERHEAD_TOKENS, Admission, PoolRate, decide
from services.backend import BackendOverloaded


@pytest.mark.parametrize("queued,prompt,rate,admit,predicted", [
    (0, 100, None, True, None),        # nothing measured yet: admit
    (0, 10_000, 1000.0, True, 10.0),   # empty queue: admit even a prompt that alone breaks the SLO
    (900, 100, 1000.0, True, 1.0),     # 1.0 s <= 2 s
    (1900, 100, 1000.0, True, 2.0),    # exactly the SLO
    (2900, 100, 1000.0, False, 3.0),   # 3 s > 2 s
])
def test_decide(queued, prompt, rate, admit, predicted):
    d = decide(queued, prompt, rate, ttft_slo_s=2.0)
    assert d.admit is admit
    assert d.predicted_ttft_s == predicted


def test_retry_after_is_the_excess_rounded_up_and_at_least_one_second():
    assert decide(5000, 500, 1000.0, 2.0).retry_after_s == 4.0   # 5.5 s predicted, 3.5 s over
    assert decide(2050, 0, 1000.0, 2.0).retry_after_s == 1.0     # 0.05 s over


def _measured(rate: PoolRate, tokens: int, seconds: float, samples: int = MIN_SAMPLES) -> None:
    for i in range(samples):
        rate.enqueue(tokens, now=1000.0 * i)
        rate.dequeue(tokens, now=1000.0 * i + seconds, completed=True)


def test_pool_rate_counts_busy_time_only_and_waits_for_enough_samples():
    rate = PoolRate()
    _measured(rate, 100, 0.5, samples=MIN_SAMPLES - 1)  # 100 tokens per 0.5 busy s ...
    assert rate.rate_tps is None                         # ... but too few samples to judge
    _measured(rate, 100, 0.5, samples=1)
    assert rate.rate_tps == pytest.approx(200.0)
    rate.enqueue(300, now=1e6)                  # idle time before this does not count
    rate.enqueue(300, now=1e6 + 0.5)
    rate.dequeue(300, now=1e6 + 1.0, completed=True)    # 300 in 1 s
    rate.dequeue(300, now=1e6 + 1.5, completed=False)   # failed before its first token: no sample
    assert rate.rate_tps == pytest.approx((MIN_SAMPLES * 100 + 300) / (MIN_SAMPLES * 0.5 + 1.0))
    assert rate.queued_tokens == 0 and rate.queued_requests == 0


def test_admission_sheds_with_retry_after_and_tickets_give_back():
    adm = Admission(ttft_slo_s=1.0, max_in_flight=100)
    _measured(adm.rates.setdefault("prefill", PoolRate()), 1000, 1.0)  # measured: 1000 tokens/s
    first = adm.admit("prefill", 1000 - REQUEST_OVERHEAD_TOKENS)          # the queue was empty
    with pytest.raises(BackendOverloaded, match="admission.ttft_slo_s") as err:
        adm.admit("prefill", 500)                      # over 1.5 s predicted behind the queued 1000
    assert err.value.retry_after_s == 1.0 and adm.num_shed == 1
    other = adm.admit("decode", 500)                   # pools are measured apart
    first.first_token()
    assert adm.rates["prefill"].queued_tokens == 0
    again = adm.admit("prefill", 500)                  # the queue drained: admitted
    for ticket in (first, other, again, first):        # close twice: no double count
        ticket.close()
    assert adm.in_flight == 0 and adm.rates["prefill"].queued_requests == 0


def test_a_cold_first_completion_does_not_shed_a_burst():
    adm = Admission(ttft_slo_s=2.0, max_in_flight=100)
    probe = adm.admit("prefill", 3)
    probe.first_token()                      # whatever its latency: one sample
    tickets = [adm.admit("prefill", 40) for _ in range(10)]  # ten requests at once: all admitted
    assert len(tickets) == 10 and adm.num_shed == 0


def test_in_flight_cap_is_a_429():
    adm = Admission(ttft_slo_s=1.0, max_in_flight=2)
    adm.admit("prefill", 1), adm.admit("prefill", 1)
    with pytest.raises(BackendOverloaded, match="max_in_flight"):
        adm.admit("prefill", 1)
    assert adm.num_over_capacity == 1


def test_shedding_off_admits_everything_up_to_the_cap():
    adm = Admission(ttft_slo_s=0.001, max_in_flight=10, shed=False)
    _measured(adm.rates.setdefault("prefill", PoolRate()), 1, 1.0)
    adm.admit("prefill", 10_000)
    adm.admit("prefill", 10_000)
    assert adm.in_flight == 2
