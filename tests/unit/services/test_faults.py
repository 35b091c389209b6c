"""Fault injection is inert unless the cluster's config (fault_injection) or
the gateway's environment enables it."""

from __future__ import annotations

import pytest

from pdcluster.services.pools import faults


def test_off_without_the_environment_switch(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.parse("kill_prefill_engine") == ()


def test_the_config_switch_decides_whatever_the_environment_says(monkeypatch):
    from pdcluster.services.config import ClusterConfig

    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.parse("fail_pull", on=True) == ("fail_pull",)
    monkeypatch.setenv(faults.ENV, "1")
    assert faults.parse("fail_pull", on=False) == ()
    assert faults.parse("fail_pull") == ("fail_pull",)  # no switch given: the environment's
    assert ClusterConfig().fault_injection is False
    assert ClusterConfig.model_validate({"fault_injection": True}).fault_injection is True


def test_parsed_when_enabled_and_unknown_kinds_dropped(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    got = faults.parse("short_lease, delay_pull:1.5,rm -rf,stall_decode:x")
    assert got == ("short_lease", "delay_pull:1.5", "stall_decode:x")
    assert faults.has(got, "delay_pull") and not faults.has(got, "fail_pull")
    assert faults.seconds(got, "delay_pull") == 1.5
    assert faults.seconds(got, "stall_decode", default=2.0) == 2.0  # unparsable: the default
    assert faults.seconds(("delay_pull:1e9",), "delay_pull") == 600.0  # bounded


def test_drop_stream_once_breaks_only_the_first_attempt():
    faults.drop_stream(("drop_stream_once",), 0)  # nothing sent yet: nothing to break
    with pytest.raises(RuntimeError, match="stream broke"):
        faults.drop_stream(("drop_stream_once",), 1)
    faults.drop_stream(("drop_stream_once",), 1, resumed=True)  # the resumed attempt streams on
    with pytest.raises(RuntimeError, match="stream broke"):
        faults.drop_stream(("drop_stream",), 1, resumed=True)  # drop_stream breaks every attempt
