"""Per-tenant token buckets (pdcluster/services/openai/rate_limits.py), a table on a
hand-driven clock: a tenant within its rate is let in, one over it gets the
seconds until it would pass, other tenants are untouched."""

import pytest

from pdcluster.services.openai.rate_limits import TenantLimit, TenantRateLimits, TokenBucket


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("rate, burst_s, costs, expected", [
    (2.0, 1.0, [1, 1], [0.0, 0.0]),                  # a full bucket of 2 lets 2 in at once
    (2.0, 1.0, [1, 1, 1], [0.0, 0.0, 0.5]),          # the third waits half a second
    (1.0, 1.0, [5], [0.0]),                          # larger than the bucket: passes alone when full ...
    (1.0, 1.0, [5, 1], [0.0, 5.0]),                  # ... and leaves a debt of 4 (5 s to one unit)
    (10.0, 0.5, [3, 3], [0.0, 0.1]),                 # capacity 5: 2 left, 1 short at 10/s
])
def test_bucket_table(rate, burst_s, costs, expected):
    bucket = TokenBucket.full(rate, burst_s, 1.0, now=0.0)
    assert [pytest.approx(bucket.take(c, now=0.0)) for c in costs] == expected


def test_a_bucket_refills_at_its_rate_up_to_its_capacity():
    bucket = TokenBucket.full(2.0, 1.0, 1.0, now=0.0)
    assert bucket.take(2, 0.0) == 0.0 and bucket.take(1, 0.0) == pytest.approx(0.5)
    assert bucket.take(1, 0.5) == 0.0          # refilled one unit in 0.5 s
    assert bucket.take(2, 100.0) == 0.0 and bucket.take(1, 100.0) > 0  # never more than its capacity


def test_tenants_are_limited_apart_and_the_refusal_names_the_limit():
    clock = Clock()
    limits = TenantRateLimits([TenantLimit("a", requests_per_s=1.0), TenantLimit("b", tokens_per_s=100.0)], clock)
    assert limits.admit_request("a") is None
    refused = limits.admit_request("a")
    assert refused is not None and refused.tenant == "a" and refused.retry_after_header == "1"
    assert "tenant 'a' is over its limit of 1 requests/s" in refused.message
    assert limits.admit_request("b") is None and limits.admit_request("nobody") is None  # no request limit
    assert limits.admit_tokens("b", 100) is None
    refused = limits.admit_tokens("b", 50)
    assert refused is not None and "100 tokens/s" in refused.message and "counts 50" in refused.message
    assert refused.retry_after_s == pytest.approx(0.5)
    clock.now += 0.5
    assert limits.admit_tokens("b", 50) is None and limits.admit_request("a") is not None  # 1 s for a's next
    clock.now += 0.5
    assert limits.admit_request("a") is None


def test_no_limit_configured_is_falsy_and_refuses_nothing():
    limits = TenantRateLimits([TenantLimit("a")])
    assert not limits and limits.admit_request("a") is None and limits.admit_tokens("a", 10**9) is None


@pytest.mark.parametrize("rate", [5e-324, 1e-300, 1e308])
def test_extreme_rates_never_break_the_answer(rate):
    # A denormal rate makes the wait infinite, a huge one the bucket infinite: the 429's
    # Retry-After stays a whole number of seconds between 1 and a day, or nothing is refused.
    limits = TenantRateLimits([TenantLimit("t", requests_per_s=rate, tokens_per_s=rate)], Clock())
    answers = [limits.admit_request("t"), limits.admit_request("t"), limits.admit_tokens("t", 10**6),
               limits.admit_tokens("t", 10**6)]
    for refused in answers:
        if refused is not None:
            assert 1 <= int(refused.retry_after_header) <= 86_400
    assert (answers[1] is None) == (rate > 1)
