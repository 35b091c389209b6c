"""The topology section: placement becomes Ray's own scheduling options, the
internal address is loopback unless set, a network address needs a Redis
password, and `pdcluster up --head` fills in the multi-host default."""

import pytest

from pdcluster.services.app import SHUTDOWN_POLL_S, build_app
from pdcluster.services.cli.head import with_multi_host_topology
from pdcluster.services.config import ClusterConfig
from pdcluster.services.topology import TopologySettings, multi_host_defaults


def test_defaults_stay_on_one_host():
    topology = ClusterConfig().topology
    assert topology.internal_host == "127.0.0.1" and not topology.spans_hosts
    assert topology.internal_address() == "127.0.0.1"
    assert all(topology.actor_options(p) == {} for p in ("gateway", "prefill", "decode", "colocated"))


def test_placement_maps_to_label_selector_and_resources():
    config = ClusterConfig.model_validate({"topology": {
        "prefill": {"node_selector": {"pdcluster/role": "prefill"}, "resources": {"kv_nic": 1}},
        "decode": {"node_selector": {"pdcluster/role": "decode"}}}})
    assert config.topology.actor_options("prefill") == {"label_selector": {"pdcluster/role": "prefill"},
                                                        "resources": {"kv_nic": 1.0}}
    app = build_app(config)
    deployments = {d.name: d for d in _deployments(app)}
    assert deployments["prefill"].ray_actor_options["label_selector"] == {"pdcluster/role": "prefill"}
    assert deployments["prefill"].ray_actor_options["resources"] == {"kv_nic": 1.0}
    assert deployments["decode"].ray_actor_options["label_selector"] == {"pdcluster/role": "decode"}
    assert "label_selector" not in deployments["gateway"].ray_actor_options


@pytest.mark.parametrize("timeout_s", [0.0, 45.0])
def test_a_stopped_pool_replica_drains_for_the_configured_shutdown_timeout(timeout_s):
    """Scale-down drains like SIGTERM: Serve's graceful shutdown of each pool replica is shutdown_timeout_s."""
    deployments = {d.name: d for d in _deployments(build_app(ClusterConfig(shutdown_timeout_s=timeout_s)))}
    assert {n: deployments[n]._deployment_config.graceful_shutdown_timeout_s for n in ("prefill", "decode")} == \
        {"prefill": timeout_s, "decode": timeout_s}


def test_a_stopping_replica_with_nothing_in_flight_is_not_held_for_serves_2_s_poll():
    deployments = {d.name: d for d in _deployments(build_app(ClusterConfig()))}
    assert {n: d._deployment_config.graceful_shutdown_wait_loop_s for n, d in deployments.items()} == \
        {"gateway": SHUTDOWN_POLL_S, "prefill": SHUTDOWN_POLL_S, "decode": SHUTDOWN_POLL_S}
    assert SHUTDOWN_POLL_S < 2.0  # Serve's default


def _deployments(app) -> list:
    """Every deployment bound in ``app`` (the ingress and its arguments)."""
    found, todo = [], [app._bound_deployment]
    while todo:
        d = todo.pop()
        found.append(d)
        todo += [v._bound_deployment for v in d.init_kwargs.values() if hasattr(v, "_bound_deployment")]
    return found


@pytest.mark.parametrize("bad, message", [
    ({"internal_host": "db.example.com"}, "is not an IP address"),
    ({"prefill": {"node_selector": {"bad key!": "x"}}}, "topology.prefill.node_selector"),
    ({"decode": {"placement": {}}}, "Extra inputs"),
])
def test_bad_topology_is_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig.model_validate({"topology": bad})


def test_network_redis_needs_a_password():
    spans = {"internal_host": "node"}
    with pytest.raises(ValueError, match="give index_url a password"):
        ClusterConfig.model_validate({"topology": spans, "index_url": "redis://10.0.0.1:6379/0"})
    ok = ClusterConfig.model_validate({"topology": spans, "index_url": "redis://:pw@10.0.0.1:6379/0"})
    assert ok.topology.spans_hosts
    # on loopback a password-less Redis stays allowed, as before
    assert ClusterConfig.model_validate({"index_url": "redis://127.0.0.1:6379/0"}).index_url


def test_up_head_fills_the_multi_host_default_only_when_the_config_set_none():
    assert with_multi_host_topology(ClusterConfig()).topology == multi_host_defaults()
    own = ClusterConfig.model_validate({"topology": {"internal_host": "10.0.0.1"}})
    assert with_multi_host_topology(own).topology == own.topology
    defaults = multi_host_defaults()
    assert defaults.actor_options("gateway") == {"label_selector": {"pdcluster/head": "true"}}
    assert defaults.internal_host == "node" and defaults != TopologySettings()
