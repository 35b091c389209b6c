"""Issue 32 on the layout a bare `pdcluster up` starts on a machine with 2
cores or fewer (pdcluster/services/cli/default_layout.py: one colocated
replica on both cores), shedding on: an idle cluster serves a burst of 16
short chats and one of 8 200-token streams, as the disaggregated layout does
(test_serve_what_can_be_served.py), and the next turns of six chats whose
histories it caches, and a SIGKILL of its only replica under 4
requests/s loses no request (they wait for Serve's replacement), nor refuses one:
the first tokens of the requests that waited out the restart are no calibration
samples (admission.py).  Its own cluster, stopped at the end of this module,
before that module's starts."""

from __future__ import annotations

import httpx
import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.cli.default_layout import default_layout
from pdcluster.services.config import ClusterConfig
from tests.integration.admission.test_serve_what_can_be_served import (loses_nothing_when_its_only_replica_of,
                                                                       serves_chat_turns_with_cached_histories,
                                                                       serves_eight_simultaneous_streams_whole,
                                                                       serves_sixteen_simultaneous_chats)
from tests.integration.cluster.conftest import board, directory_cluster
from tests.integration.cluster.test_cluster_api import MODEL

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_core_default(shared_ray):
    layout = default_layout(2)
    assert layout["mode"] == "colocated"
    yield from directory_cluster(shared_ray, ClusterConfig(port=free_service_port(), **layout), [])


def test_sixteen_simultaneous_short_chats_are_all_served(two_core_default):
    serves_sixteen_simultaneous_chats(f"http://127.0.0.1:{two_core_default.config.port}", two_core_default)


def test_admission_starts_from_the_replicas_start_up_prefill_time(two_core_default):
    """The replica timed its own prefill and decode step at start-up (startup_profile.py) and
    published them; the gateway's admission took those lines in place of the configured ones."""
    url = f"http://127.0.0.1:{two_core_default.config.port}"
    (entry,) = [s for s in board(two_core_default) if s["role"] == "colocated"]
    measured = entry["prefill_per_token_s"]
    assert 0 < measured < 1, entry
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    view = httpx.get(f"{url}/health", timeout=10).json()["admission"]
    model = view["prefill_model"]
    assert model.startswith("measured at start-up") and f"{measured:.4g} s x prompt tokens" in model, (model, measured)
    square = entry["prefill_per_token2_s"]  # timed through a long prompt too: the whole line, no step overhead
    assert 0 <= square < 1e-3 and model.startswith("measured at start-up: 0 s + "), (model, entry)
    assert square == 0 or f"{square:.4g} s x prompt tokens^2" in model, (model, entry)
    # and the decode step line the colocated replica timed (batch 1 and 16), in place of the configured one
    base, per_seq = entry["decode_step_s"]
    assert 0 < base < 1 and 0 <= per_seq < 1, entry
    assert view["step_model"] == f"measured at start-up: {base:.4g} s + {per_seq:.4g} s x streams", (view, entry)


def test_eight_simultaneous_200_token_streams_are_all_served_whole(two_core_default):
    serves_eight_simultaneous_streams_whole(f"http://127.0.0.1:{two_core_default.config.port}", two_core_default)


def test_the_next_turns_of_six_chats_with_cached_histories_are_all_served(two_core_default):
    serves_chat_turns_with_cached_histories(f"http://127.0.0.1:{two_core_default.config.port}", two_core_default)


def _left_out(url: str) -> int:
    """First tokens the gateway's admission left out of its calibration (/health's view)."""
    return httpx.get(f"{url}/health", timeout=10).json()["admission"]["pools"]["decode"]["calibration"]["left_out"]


def test_sigkill_of_the_only_replica_under_4_rps_loses_no_request(two_core_default):
    url = f"http://127.0.0.1:{two_core_default.config.port}"
    before = _left_out(url)
    loses_nothing_when_its_only_replica_of("colocated", url, two_core_default)
    assert _left_out(url) > before  # at least the request sent just after the kill waited for the replacement
