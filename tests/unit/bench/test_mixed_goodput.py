"""The goodput judgement of bench/load/mixed_goodput.py: served, TTFT and
TPOT within the SLO; a refusal is a miss; short chats counted apart."""

from __future__ import annotations

import math

import pytest

from bench.load.client import RequestRecord
from bench.load.mixed_goodput import goodput, is_good, misses, workloads
from bench.load.overload import judge


def rec(bucket="short_chat", ttft=0.5, e2e=3.0, out=64, error=None) -> RequestRecord:
    return RequestRecord(index=0, bucket=bucket, tenant="t", input_tokens=100, output_tokens=out,
                         planned_output_tokens=out, start_s=0.0, ttft_s=ttft, e2e_s=e2e, error=error)


@pytest.mark.parametrize("record, good", [
    (rec(), True),                                   # TPOT (3 - 0.5) / 63 = 40 ms
    (rec(ttft=2.1), False),                          # late first token
    (rec(e2e=10.0), False),                          # TPOT 151 ms
    (rec(out=1, e2e=0.5), True),                     # one token: no TPOT to judge
    (rec(error="http_429", ttft=None, e2e=None), False),
])
def test_is_good(record, good):
    assert is_good(record) is good


def test_goodput_counts_refusals_as_misses_and_chats_apart():
    g = goodput([rec(), rec(error="http_429", ttft=None, e2e=None), rec(bucket="burst_3k", ttft=4.0)])
    assert (g.sent, g.served, g.refused, g.good, g.chats, g.chats_good) == (3, 2, 1, 1, 2, 1)
    assert g.ratio == pytest.approx(1 / 3)
    assert g.misses == "short_chat http_429 1, burst_3k ttft 1"


def test_misses_name_the_bucket_and_the_reason_most_first():
    assert misses([rec(e2e=10.0), rec(bucket="long_input", ttft=2.5), rec(bucket="long_input", ttft=3.0),
                   rec()]) == "long_input ttft 2, short_chat tpot 1"
    assert misses([rec()]) == "none"


def test_workloads_scale_the_rates_and_burst_period():
    cases = workloads(0.5, 60.0)
    assert cases["i_mix"][0].arrival.rate_rps == 0.5
    chats, bursts = cases["ii_bursts"]
    assert chats.arrival.rate_rps == 0.5 and bursts.arrival.period_s == 40.0 and bursts.arrival.burst_size == 4


def test_overload_judges_refusals_their_retry_after_and_the_admitted_tail():
    records = [rec(ttft=t) for t in (0.4, 1.9, 0.8, 2.5)] + [
        rec(error="http_429", ttft=None, e2e=None), rec(error="http_503", ttft=None, e2e=None)]
    records[4].retry_after = "2"
    judged = judge(records, capacity_rps=7.0)
    assert (judged.sent, judged.refused, judged.refused_with_retry_after, judged.errors) == (6, 1, 1, 1)
    assert judged.admitted_ttft_s == (0.4, 0.8, 1.9, 2.5)
    assert judged.ttft_quantile(0.5) == 1.9 and judged.ttft_quantile(0.99) == 2.5 and judged.ttft_quantile(1.0) == 2.5
    assert judged.retry_after_share == 1.0


@pytest.mark.parametrize("header", [None, "0", "soon", ""])
def test_a_refusal_without_a_usable_retry_after_is_counted_apart(header):
    refused = rec(error="http_429", ttft=None, e2e=None)
    refused.retry_after = header
    assert judge([refused], 1.0).retry_after_share == 0.0


def test_nothing_refused_or_admitted_reads_nan_so_its_target_is_missed():
    judged = judge([], 1.0)
    assert math.isnan(judged.retry_after_share) and math.isnan(judged.ttft_quantile(0.99))
