"""The suite's per-test CPU report reads /proc/stat's first line."""

import pytest

from tests.cpu_report import Spent, busy_core_seconds


def test_busy_counts_everything_but_idle_and_iowait():
    stat = "cpu  100 20 30 4000 500 6 7 8 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    assert busy_core_seconds(stat, 100.0) == pytest.approx((100 + 20 + 30 + 6 + 7 + 8) / 100.0)


def test_not_proc_stat_is_an_error():
    with pytest.raises(ValueError, match="not /proc/stat"):
        busy_core_seconds("intr 1 2 3\n", 100.0)


def test_a_line_shows_the_idle_core_seconds_never_below_zero():
    assert Spent("t::a", 10.0, 15.0).line(2).split("\t")[2].strip() == "5.00"
    assert Spent("t::b", 1.0, 3.0).line(2).split("\t")[2].strip() == "0.00"
