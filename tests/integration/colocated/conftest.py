"""One real colocated cluster per session (one engine doing both phases), in
fp32 so its logprobs can be held to transformers' fp32 within 1e-3: the
same fixtures as tests/integration/cluster (``cluster``, ``client``), so
tests written there run here unchanged (import them into a module here).
No SLO shedding: one fp32 replica on a shared CPU would 429 bursts (n > 1,
batches of schemas) that these feature tests send on purpose; shedding has
its own tests in tests/integration/faults."""

from __future__ import annotations

import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import AdmissionSettings, ClusterConfig
from tests.integration.cluster.conftest import directory_cluster, small_pool, stop_after_directory

_RUNNING: list = []


def pytest_runtest_teardown(item, nextitem):
    stop_after_directory(item, nextitem, _RUNNING)


@pytest.fixture(scope="session")
def colocated_trace_file(tmp_path_factory):
    return tmp_path_factory.mktemp("colocated-traces") / "spans.jsonl"


@pytest.fixture(scope="session")
def colocated_cluster(shared_ray, colocated_trace_file):
    config = ClusterConfig(port=free_service_port(), mode="colocated", dtype="float32",
                           colocated=small_pool(num_replicas=1), lease_ttl_s=120.0,
                           trace_file=str(colocated_trace_file),  # every process's spans in one file
                           admission=AdmissionSettings(shed=False))
    yield from directory_cluster(shared_ray, config, _RUNNING)


@pytest.fixture(scope="session")
def cluster(colocated_cluster):
    return colocated_cluster


@pytest.fixture(scope="session")
def client(colocated_cluster):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{colocated_cluster.config.port}/v1", api_key="unused",
                         max_retries=0, timeout=120)
