"""KV leases that cannot lie, on a real cluster with a 120 s lease TTL: a
pull after the lease ran out is refused (never read), and the request is
recomputed on the decode side instead (failover, issue 19); on every path
where no pull happens the prefill blocks come back within 2 s, not at
the TTL."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.faults.conftest import MODEL, ok_request, post, wait_hand_off, wait_no_leaks, wait_serving

pytestmark = pytest.mark.integration
BODY = {"prompt": "Explain in one paragraph why the sky is blue. " * 4, "max_tokens": 16, "temperature": 0}


@pytest.fixture(autouse=True)
def _hand_off_path(faults_cluster):
    wait_hand_off(faults_cluster)


def _failovers(url: str, reason: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    line = next((ln for ln in text.splitlines() if ln.startswith(f'pdcluster_failovers_total{{reason="{reason}"}}')),
                None)
    return float(line.split()[-1]) if line else 0.0


def test_a_pull_after_the_lease_expired_is_refused_and_recomputed(url, faults_cluster):
    reference = post(url, BODY)
    before = _failovers(url, "kv_lease_expired")
    r = post(url, BODY, fault="short_lease,delay_pull:1.5")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    assert _failovers(url, "kv_lease_expired") == before + 1  # refused, then resumed: never read
    wait_no_leaks(faults_cluster)
    ok_request(url)


def test_a_block_changed_after_the_hand_off_is_refused_and_recomputed(url, faults_cluster):
    # The prompt's last block is partial here (a full one would not be overwritten by the fault): the
    # prefill replica zeroes it after taking its checksum, as a block released early and reused would
    # look to a pull.  The decode side must refuse it (never decode from it or cache it) and the
    # request is recomputed: the same greedy text.  Before checksums, the zeroed block was decoded from.
    reference = post(url, BODY)
    assert reference.json()["usage"]["prompt_tokens"] % faults_cluster.config.block_size, "pick a partial last block"
    before = _failovers(url, "kv_transfer_failed")
    r = post(url, BODY, fault="reuse_leased_block")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    assert _failovers(url, "kv_transfer_failed") == before + 1
    wait_no_leaks(faults_cluster)
    ok_request(url)


def test_client_disconnect_right_after_the_first_token(url, faults_cluster):
    body = {"model": MODEL, **BODY, "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the first token; leave now
    wait_no_leaks(faults_cluster)


def test_client_disconnect_while_the_decode_replica_pulls_leaves_the_release_to_it(url, faults_cluster):
    # The decode call is on its replica, about to pull (delay_pull): the gateway must not release the
    # lease under it (a one-sided READ could then read reused blocks); the decode replica releases once
    # its pull was cancelled.  Nothing leaks, and within seconds, not at the 120 s TTL.
    body = {"model": MODEL, **BODY, "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=body,
                         headers={"x-pdcluster-fault": "delay_pull:3"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # the first token (from the prefill replica); the pull waits 3 s: leave now
    wait_no_leaks(faults_cluster, timeout_s=10.0)
    ok_request(url)


@pytest.mark.parametrize("fault, status, code", [("reject_decode", 200, None),  # offered again: a seat
                                                 ("fail_pull", 200, None)])  # recomputed on the decode side
def test_decode_refusal_and_pull_failure_release_the_lease(url, faults_cluster, fault, status, code):
    r = post(url, BODY, fault=fault)
    assert r.status_code == status, r.text
    if code is not None:
        assert r.json()["error"]["code"] == code
    wait_no_leaks(faults_cluster)
    ok_request(url)


def test_decode_death_before_the_pull_releases_the_lease(url, faults_cluster):
    r = post(url, BODY, fault="die_before_pull")
    assert r.status_code >= 500, r.text
    wait_no_leaks(faults_cluster, roles=("prefill",))  # the decode replica is gone; its blocks with it
    wait_serving(url)
    wait_no_leaks(faults_cluster)
