"""KV tiers on a real colocated cluster (Ray Serve, Redis index, gateway):
a prompt whose blocks the replica's small pool evicted is served from its
host and disk tiers -- the same greedy text as its first answer, its prompt
tokens reported cached -- the index holds tier members for the replica,
and `pdcluster status`'s board shows the loads."""

from __future__ import annotations

import time

import redis

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import AdmissionSettings, ClusterConfig, KVTierSettings
from pdcluster.services.pools.status_board import read_board
from tests.integration.cluster.conftest import small_pool
from tests.integration.engine.conftest import document


def test_a_prefix_evicted_from_the_pool_comes_back_from_the_tiers(shared_ray, tmp_path):
    import openai

    config = ClusterConfig(port=free_service_port(), mode="colocated",
                           colocated=small_pool(num_replicas=1, kv_cache_mib=8),  # 22 bf16 blocks
                           kv_tiers=KVTierSettings(enabled=True, host_mib=2, disk_mib=64, dir=str(tmp_path)),
                           admission=AdmissionSettings(shed=False))
    with shared_ray.running(config) as cluster:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{config.port}/v1", api_key="unused", max_retries=0,
                               timeout=120)

        def complete(prompt: str):
            return client.completions.create(model=config.served_model_name, prompt=prompt, max_tokens=8,
                                             temperature=0)

        prompts = [document(14, k) for k in (0, 2, 4, 6)]
        first = complete(prompts[0])
        for p in prompts[1:]:  # each fills most of the pool: the first prompt's blocks leave it
            complete(p)
        again = complete(prompts[0])
        assert again.choices[0].text == first.choices[0].text
        assert again.usage.prompt_tokens_details.cached_tokens >= 128, again.usage

        tiers = _tiers_once_published(cluster.config.index_url, cluster.config.cluster_name)
        assert tiers["host"]["loaded_blocks"] + tiers["disk"]["loaded_blocks"] >= 8, tiers
        assert tiers["disk"]["blocks"] > 0 and tiers["load_failures"] == 0, tiers

        r = redis.Redis.from_url(cluster.config.index_url)
        members = {m for key in r.scan_iter(match="pdc:*:b:*") for m in r.smembers(key)}
        r.close()
        assert any(m.endswith(b"#disk") for m in members) and any(b"#" not in m for m in members)
    assert not list(tmp_path.glob("*/*.kvb"))  # the replica's disk tier went with it


def _tiers_once_published(url: str, cluster: str, wait_s: float = 30.0) -> dict:
    """The replica's tier view once its status board has caught up with the
    last request (it publishes every half second; reading at once may see the
    status from before it)."""
    deadline = time.monotonic() + wait_s
    while True:
        [board] = read_board(url, cluster)
        tiers = board["kv_tiers"]
        if tiers["host"]["loaded_blocks"] + tiers["disk"]["loaded_blocks"] or time.monotonic() > deadline:
            return tiers
        time.sleep(0.5)
