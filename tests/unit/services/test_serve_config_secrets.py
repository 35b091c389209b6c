"""Nothing bound into Serve's config -- deployment arguments, options,
``request_router_kwargs``, all shown at the dashboard's
``/api/serve/applications/`` -- holds the Redis password."""

from __future__ import annotations

import json

import pytest

from pdcluster.prefix_store.url_reference import resolve_index_url
from pdcluster.services.app import build_app
from pdcluster.services.config import ClusterConfig

PASSWORD = "pw-7f3a9c-do-not-show"
URL = f"redis://:{PASSWORD}@127.0.0.1:6379/0"


def _deployments(app) -> list:
    found, todo = [], [app._bound_deployment]
    while todo:
        d = todo.pop()
        found.append(d)
        todo += [v._bound_deployment for v in d.init_kwargs.values() if hasattr(v, "_bound_deployment")]
    return found


def _everything_serve_sees(d) -> str:
    cfg = d._deployment_config
    router = cfg.request_router_config
    return json.dumps({"args": d.init_args, "kwargs": {k: v for k, v in d.init_kwargs.items()
                                                       if not hasattr(v, "_bound_deployment")},
                       "config": cfg.model_dump() if hasattr(cfg, "model_dump") else cfg.dict(),
                       "router_kwargs": router.request_router_kwargs if router else None,
                       "actor": d.ray_actor_options}, default=repr)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_no_deployment_carries_the_redis_password(mode, monkeypatch):
    monkeypatch.setenv("PDCLUSTER_CLUSTER_SECRET", "ab" * 32)
    monkeypatch.delenv("REDIS_URL", raising=False)
    app = build_app(ClusterConfig(index_url=URL, mode=mode))
    deployments = _deployments(app)
    assert len(deployments) == (3 if mode == "disaggregated" else 2)
    routed = 0
    for d in deployments:
        seen = _everything_serve_sees(d)
        assert PASSWORD not in seen, d.name
        router = d._deployment_config.request_router_config
        if router and router.request_router_kwargs.get("index_url"):
            routed += 1
            assert resolve_index_url(router.request_router_kwargs["index_url"]) == URL  # read back in-process
        assert resolve_index_url(d.init_args[0]["index_url"]) == URL
    assert routed == len(deployments) - 1  # every pool's router has the reference
