"""`pdcluster up --head` / `pdcluster join` are `ray start` with our labels
and environment: the commands, the multi-node switch, and the refusal to
start a node of a multi-host cluster without the cluster secret."""

import pytest

from pdcluster.services import cluster_env as env_module
from pdcluster.services.cli.main import main
from pdcluster.services.cluster_secret import CLUSTER_SECRET_ENV
from pdcluster.services.cli.ray_node import head_command, join_command, node_env, node_labels

SECRET = "ab" * 32


def test_labels_name_the_role_and_the_head():
    assert node_labels("decode", head=False) == "pdcluster/role=decode"
    assert node_labels("prefill", head=True) == "pdcluster/role=prefill,pdcluster/head=true"
    with pytest.raises(ValueError, match="unknown role"):
        node_labels("gpu", head=False)


def test_commands_are_ray_start_blocking_with_labels():
    head = head_command("10.0.0.1", 6380, num_cpus=4)
    assert head[1:4] == ["start", "--head", "--block"]
    assert "--node-ip-address=10.0.0.1" in head and "--port=6380" in head and "--num-cpus=4" in head
    assert "--labels=pdcluster/role=head,pdcluster/head=true" in head
    join = join_command("10.0.0.1:6380", "decode", node_ip="10.0.0.2", temp_dir="/tmp/x")
    assert "--address=10.0.0.1:6380" in join and "--node-ip-address=10.0.0.2" in join
    assert "--labels=pdcluster/role=decode" in join and "--temp-dir=/tmp/x" in join and "--head" not in join


def test_node_env_leaves_loopback_and_needs_the_secret():
    env = node_env({"UCX_NET_DEVICES": "lo", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", CLUSTER_SECRET_ENV: SECRET})
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
    assert "UCX_NET_DEVICES" not in env  # each replica takes the device of its own address
    assert env["RAY_AUTH_MODE"] == "token"
    with pytest.raises(SystemExit, match=CLUSTER_SECRET_ENV):
        node_env({})
    with pytest.raises(ValueError, match="is not hex"):
        node_env({CLUSTER_SECRET_ENV: "zz-not-hex-zz"})


def test_cluster_env_multi_node_wins_over_the_loopback_default(monkeypatch):
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # restored after the test (multi_node sets it when unset)
    import ray._private.ray_constants as constants

    monkeypatch.setattr(constants, "ENABLE_RAY_CLUSTER", False)
    env_module.cluster_env(multi_node=True)
    assert constants.ENABLE_RAY_CLUSTER is True
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    env_module.cluster_env()
    assert constants.ENABLE_RAY_CLUSTER is False


def test_join_dry_run_prints_the_ray_start_command(monkeypatch, capsys):
    monkeypatch.setenv(CLUSTER_SECRET_ENV, SECRET)
    assert main(["join", "10.0.0.1:6379", "--role", "prefill", "--node-ip", "10.0.0.3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ray start --block" in out and "--labels=pdcluster/role=prefill" in out and SECRET not in out


def test_join_refuses_without_the_secret_or_a_port(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    with pytest.raises(SystemExit, match=CLUSTER_SECRET_ENV):
        main(["join", "10.0.0.1:6379", "--role", "decode", "--dry-run"])
    with pytest.raises(SystemExit, match="HOST:PORT"):
        main(["join", "10.0.0.1", "--role", "decode", "--dry-run"])


def test_up_head_needs_a_node_ip_and_the_secret(monkeypatch):
    monkeypatch.setenv(CLUSTER_SECRET_ENV, SECRET)
    with pytest.raises(SystemExit, match="--node-ip"):
        main(["up", "--head"])
    monkeypatch.delenv(CLUSTER_SECRET_ENV)
    with pytest.raises(SystemExit, match=CLUSTER_SECRET_ENV):
        main(["up", "--head", "--node-ip", "10.0.0.1"])


def test_status_node_table_shows_roles_heads_and_dead_nodes():
    from pdcluster.services.cli.ray_node import node_lines

    nodes = [{"NodeID": "b" * 56, "NodeManagerAddress": "10.0.0.2", "Alive": False,
              "Labels": {"pdcluster/role": "decode"}, "Resources": {"CPU": 2.0}},
             {"NodeID": "a" * 56, "NodeManagerAddress": "10.0.0.1", "Alive": True,
              "Labels": {"pdcluster/role": "prefill", "pdcluster/head": "true"}, "Resources": {"CPU": 4.0}}]
    header, head, dead = node_lines(nodes)
    assert header.split()[:3] == ["node", "address", "state"]
    assert head.split() == ["aaaaaaaaaaaa", "10.0.0.1", "alive", "prefill", "yes", "4"]
    assert dead.split() == ["bbbbbbbbbbbb", "10.0.0.2", "DEAD", "decode", "2"]


def test_up_prints_a_dashboard_url_only_where_ray_reported_one():
    from pdcluster.services.cli.up import SNIPPET, dashboard_line
    from pdcluster.services.cli.local_ray import http_url

    assert http_url("127.0.0.1:8265") == "http://127.0.0.1:8265" and http_url("") is None and http_url(None) is None
    assert "http://127.0.0.1:8265" in dashboard_line("http://127.0.0.1:8265", "prefill, decode")
    head = dashboard_line(None, "prefill, decode")  # `up --head`: ray start --include-dashboard=false
    assert "http" not in head and "pdcluster status" in head
    assert "--include-dashboard=false" in head_command("10.0.0.1")
    assert "{dashboard}" in SNIPPET and "8265" not in SNIPPET


def test_up_says_where_the_dashboards_auth_token_is_never_the_token():
    from pathlib import Path

    from pdcluster.services.cli.up import dashboard_line

    url, home = "http://127.0.0.1:8265", Path("/home/op")
    on = dashboard_line(url, "prefill, decode", {"RAY_AUTH_MODE": "token"}, home)
    assert "ray get-auth-token" in on and "/home/op/.ray/auth_token" in on
    custom = dashboard_line(url, "colocated", {"RAY_AUTH_MODE": "TOKEN", "RAY_AUTH_TOKEN_PATH": "/etc/ray/t"}, home)
    assert "/etc/ray/t" in custom
    from_env = dashboard_line(url, "colocated", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "s3cret-value"}, home)
    assert "RAY_AUTH_TOKEN environment variable" in from_env and "s3cret-value" not in from_env
    assert "token" not in dashboard_line(url, "colocated", {}, home).lower()
    assert "get-auth-token" not in dashboard_line(None, "colocated", {"RAY_AUTH_MODE": "token"}, home)
