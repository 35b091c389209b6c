"""One real local cluster per session: embedded Redis, Ray on loopback,
Serve with 1 prefill + 1 decode replica of the real model, the gateway on a
free loopback port."""

from __future__ import annotations

import pytest

from prefix_store.redis_server import free_port
from services.config import ClusterConfig, PoolConfig


def small_pool(**kw) -> PoolConfig:
    return PoolConfig(**({"num_cpus": 1, "num_threads": 1, "kv_cache_mib": 48, "max_queue": 8} | kw))


@pytest.fixture(scope="package")
def cluster():
    from services.cluster_runtime import LocalCluster

    config = ClusterConfig(port=free_port(), prefill=small_pool(num_replicas=2), decode=small_pool(),
                           lease_ttl_s=20.0)
    c = LocalCluster(config, num_cpus=8, dashboard=False)
    try:
        c.start(progress=lambda m: print(m, flush=True))
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="package")
def base_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.config.port}"


@pytest.fixture(scope="package")
def client(base_url):
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def board(cluster) -> list[dict]:
    """Every live replica's status (published to Redis every 0.5 s)."""
    from services.status_board import read_board

    return read_board(cluster.config.index_url, cluster.config.cluster_name)


def replica_actor(role: str):
    """A live Serve replica actor of one pool."""
    import ray
    from ray.util.state import list_actors

    for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        if a.class_name.endswith(f":{role}") or a.class_name.endswith(f"#{role}") or f"pdcluster:{role}" in a.class_name:
            return ray.get_actor(a.name, namespace=a.ray_namespace)
    raise LookupError(f"no live {role} replica")
