"""bench/micro/levers_kv.py's greedy comparison: where two runs part, and the
baseline's top-2 gap there (pure; no model)."""

import pytest

from bench.micro.levers_kv import compare, max_concurrent_sequences
from pdcluster.services.token_logprob import TokenLogprob


def lps(*gaps: float) -> list[TokenLogprob]:
    return [TokenLogprob(1, -0.1, ((1, -0.1), (2, -0.1 - g))) for g in gaps]


def test_compare_counts_identical_prompts_and_reads_the_gap_where_they_part():
    baseline = ([[1, 1, 1], [1, 1, 1], [1, 1]], [lps(1.0, 0.5, 2.0), lps(1.0, 0.25, 2.0), lps(1.0, 1.0)])
    ours = ([[1, 1, 1], [1, 2, 1], [1, 1, 1]], [None, None, None])
    g = compare(baseline, ours)
    assert g.matched == 1
    assert g.first_diff == [None, 1, 0]  # a length difference counts from token 0
    assert g.margins == [None, pytest.approx(0.25), pytest.approx(1.0)]


def test_capacity_counts_whole_sequences():
    assert max_concurrent_sequences(block_bytes=100, kv_bytes=100 * 128 * 3 + 99, block_size=16) == 3
