"""A cluster across two hosts (network namespaces joined by a veth): the
gateway and the prefill pool on the head's host, the decode pool on the
other; real requests answer exactly as a single host does (greedy), the KV
blocks the decode replica pulled crossed the veth over NIXL/UCX-TCP, and
SIGKILLing the other host's decode replica mid-stream behaves as on one host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

DRIVER = Path(__file__).with_name("two_host_driver.py")


@pytest.fixture(scope="module")
def run(two_node_cluster) -> dict:
    c = two_node_cluster
    done = subprocess.run([*c.pair.exec_prefix(c.pair.ns_a), sys.executable, str(DRIVER), c.address,
                           c.pair.ip_a, c.pair.dev_a], env=c.env, capture_output=True, text=True, timeout=420)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"driver failed ({done.returncode}):\n{done.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_greedy_answers_equal_the_single_host_engine(run):
    assert run["texts"] == run["reference"]
    assert all(run["texts"])


def test_pools_run_on_their_hosts_and_advertise_their_addresses(run, two_node_cluster):
    pair = two_node_cluster.pair
    roles = {s["role"]: s for s in run["board"]}
    assert roles["prefill"]["internal_address"] == pair.ip_a
    assert roles["decode"]["internal_address"] == pair.ip_b
    assert {s["transfer_backend"] for s in run["board"]} == {"nixl"}


def _decode_counters(board: list[dict]) -> dict:
    [decode] = [s for s in board if s["role"] == "decode"]
    return decode["counters"]


def test_kv_bytes_crossed_the_veth(run):
    """Counted around the requests alone (the readiness probe pulled before)."""
    before, after = _decode_counters(run["board_before"]), _decode_counters(run["board"])
    pulled = after["bytes_pulled"] - before["bytes_pulled"]
    assert after["blocks_pulled"] - before["blocks_pulled"] >= len(run["texts"])  # each prompt: 1+ full block
    assert pulled > 0
    assert run["veth_tx_bytes"] >= pulled  # the head's end sent at least the KV the decode host pulled


def test_killing_the_decode_hosts_replica_behaves_as_on_one_host(run):
    """Its streams resume on the respawned replica and end as if nothing happened."""
    f = run["failover"]
    assert all(f["completed"]) and f["errors"] == [[], []], f
    assert f["texts"] == f["reference"] and f["tokens"] == [24, 24], f
