"""One real local cluster per session: embedded Redis, Ray on loopback,
Serve with 1 prefill + 1 decode replica of the real model, the gateway on a
free loopback port."""

from __future__ import annotations

import pytest

from prefix_store.redis_server import free_port
from services.config import ClusterConfig, PoolConfig


def small_pool(**kw) -> PoolConfig:
    return PoolConfig(**({"num_cpus": 1, "num_threads": 1, "kv_cache_mib": 48, "max_queue": 8} | kw))


@pytest.fixture(scope="session")
def cluster():
    from services.cluster_runtime import LocalCluster

    config = ClusterConfig(port=free_port(), prefill=small_pool(), decode=small_pool(), lease_ttl_s=20.0)
    c = LocalCluster(config, num_cpus=8, dashboard=False)
    try:
        c.start(progress=lambda m: print(m, flush=True))
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def base_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.config.port}"


@pytest.fixture(scope="session")
def client(base_url):
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def pool_status(name: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(name, app_name="pdcluster").status.remote().result(timeout_s=30)
