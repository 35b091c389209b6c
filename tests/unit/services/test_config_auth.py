"""API keys in ClusterConfig (api_keys, api_key_file, PDCLUSTER_API_KEY),
the exposure rule, and `pdcluster up` refusing an exposed host without a key
before it starts anything.  Keys never show in a dump, a repr or an error:
only their sha256 digests travel (deployment args) and rest (the state file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pdcluster.services.config import API_KEY_ENV, ClusterConfig, api_key_digest, exposure_problem, is_loopback

KEY = "sk-config-test-0123456789abcdef"
OTHER = "sk-config-other-fedcba98765432"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)


HOSTS = [("127.0.0.1", True), ("127.1.2.3", True), ("localhost", True), ("LOCALHOST", True), ("::1", True),
         ("[::1]", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
         ("192.168.1.20", False), ("gateway.example.com", False), ("", False)]


@pytest.mark.parametrize("host,loopback", HOSTS)
@pytest.mark.parametrize("has_keys", [False, True])
@pytest.mark.parametrize("insecure", [False, True])
def test_exposure_needs_a_key_or_the_override_off_loopback(host, loopback, has_keys, insecure):
    assert is_loopback(host) is loopback
    problem = exposure_problem(host, has_keys, insecure)
    assert (problem is not None) == (not loopback and not has_keys and not insecure)
    if problem:
        assert API_KEY_ENV in problem and "api_keys" in problem and "--insecure-no-auth" in problem
        assert "insecure_no_auth: true" in problem


def test_the_config_refuses_an_exposed_host_without_a_key(monkeypatch):
    with pytest.raises(ValidationError, match="--insecure-no-auth"):
        ClusterConfig(host="0.0.0.0")
    assert ClusterConfig(host="0.0.0.0", insecure_no_auth=True).api_key_digests == ()
    assert ClusterConfig(host="0.0.0.0", api_keys=[KEY]).api_key_digests == (api_key_digest(KEY),)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert ClusterConfig(host="::").api_key_digests == (api_key_digest(KEY),)
    assert ClusterConfig().api_key_digests == (api_key_digest(KEY),)   # the env alone turns auth on


def test_keys_from_all_three_sources_deduplicated(monkeypatch, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# the clients' keys\n\n  {OTHER}  \n{KEY}\n   # rotated out: sk-old\n")
    monkeypatch.setenv(API_KEY_ENV, f" {KEY} ,, third-key-123456789 ")
    config = ClusterConfig(api_keys=[KEY], api_key_file=str(keys))
    assert [k.get_secret_value() for k in config.api_keys] == [KEY, OTHER, "third-key-123456789"]
    assert config.api_key_digests == tuple(api_key_digest(k) for k in (KEY, OTHER, "third-key-123456789"))
    assert config.client_api_key() == KEY


def test_digests_may_be_given_instead_of_keys():
    config = ClusterConfig(host="0.0.0.0", api_key_digests=[api_key_digest(KEY)])
    assert config.api_key_digests == (api_key_digest(KEY),) and config.client_api_key() is None
    with pytest.raises(ValidationError, match=r"api_key_digests\[0\]") as bad:
        ClusterConfig(api_key_digests=[KEY])              # a key where its digest belongs
    assert KEY not in str(bad.value)


def test_no_dump_repr_or_error_shows_a_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(OTHER + "\n")
    config = ClusterConfig(host="0.0.0.0", api_keys=[KEY], api_key_file=str(keys))
    dumped = config.model_dump()
    state = json.dumps({"config": dumped})                # what cluster_runtime writes into runs/cluster.json
    for text in (repr(config), str(config), state, config.model_dump_json(), json.dumps(config.model_dump(
            mode="json")), repr(config.api_keys)):
        assert KEY not in text and OTHER not in text
    assert "api_keys" not in dumped and "api_key_file" not in dumped
    assert tuple(dumped["api_key_digests"]) == (api_key_digest(KEY), api_key_digest(OTHER))
    with pytest.raises(ValidationError) as bad:
        ClusterConfig(api_keys=[KEY], block_size=7, mode="nope")
    assert KEY not in str(bad.value) and KEY not in repr(bad.value)


def test_a_dump_round_trips_to_the_same_digests_without_the_keys():
    """The gateway replica and `pdcluster scale` validate the dump: same
    digests (so the same deployment version), no key in clear."""
    config = ClusterConfig(host="0.0.0.0", api_keys=[KEY, OTHER])
    again = ClusterConfig.model_validate(json.loads(json.dumps(config.model_dump())))
    assert again.api_key_digests == config.api_key_digests and again.api_keys == ()
    assert again.model_dump() == config.model_dump()


@pytest.mark.parametrize("source", ["inline", "env", "file"])
def test_an_unusable_key_is_named_by_where_it_came_from_never_echoed(source, monkeypatch, tmp_path):
    bad = "has a space"
    kwargs: dict = {}
    if source == "inline":
        kwargs["api_keys"] = [KEY, bad]
    elif source == "env":
        monkeypatch.setenv(API_KEY_ENV, f"{KEY},{bad}")
    else:
        (tmp_path / "keys").write_text(f"{KEY}\n# comment\n{bad}\n")
        kwargs["api_key_file"] = str(tmp_path / "keys")
    with pytest.raises(ValidationError) as err:
        ClusterConfig(**kwargs)
    text = str(err.value)
    assert {"inline": "api_keys[1]", "env": f"{API_KEY_ENV} entry 2", "file": "line 3"}[source] in text
    assert bad not in text and KEY not in text


def test_a_missing_key_file_says_so(tmp_path):
    with pytest.raises(ValidationError, match="api_key_file .*cannot read"):
        ClusterConfig(api_key_file=str(tmp_path / "absent"))


def test_from_yaml_with_flag_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"port: 9100\napi_keys: [{KEY}]\n")
    config = ClusterConfig.from_yaml(path, {"host": "0.0.0.0", "port": 9200})
    assert (config.host, config.port, config.client_api_key()) == ("0.0.0.0", 9200, KEY)


def test_a_serve_run_file_is_refused_naming_what_up_takes(tmp_path):
    """deploy/local.yaml is for `serve run`: its `applications:` list is no cluster config."""
    local = REPO / "deploy" / "local.yaml"
    with pytest.raises(ValueError, match=r"local.yaml is a Ray Serve config .*`serve run .*local.yaml`.*"
                                         r"the pdcluster application's `args:`"):
        ClusterConfig.from_yaml(local)
    assert ClusterConfig.from_yaml(REPO / "deploy" / "race.yaml").mode == "colocated"  # the one the message names


# -- `pdcluster up` ----------------------------------------------------------------------------

def _up(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | (env or {})
    return subprocess.run([sys.executable, "-m", "pdcluster.services.cli.main", "up", *flags], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=60)


def test_up_on_an_exposed_host_without_a_key_exits_before_starting_anything():
    done = _up("--host", "0.0.0.0", "--port", "1")
    assert done.returncode != 0
    assert "refusing to serve the gateway on 0.0.0.0 without an API key" in done.stderr
    assert API_KEY_ENV in done.stderr and "--insecure-no-auth" in done.stderr
    assert "starting" not in done.stdout and "Ray" not in done.stdout   # no Redis, no Ray
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_up_with_an_unusable_env_key_names_it_without_echoing():
    done = _up("--host", "0.0.0.0", env={API_KEY_ENV: "not a key"})
    assert done.returncode != 0 and f"{API_KEY_ENV} entry 1" in done.stderr and "not a key" not in done.stderr
    assert "starting" not in done.stdout


def test_up_flags_become_the_config(monkeypatch):
    import argparse

    from pdcluster.services.cli.up import _auth_lines, load_config

    def args(**kw) -> argparse.Namespace:
        return argparse.Namespace(**({"config": None, "mode": None, "host": None, "port": None,
                                      "insecure_no_auth": False} | kw))

    open_config = load_config(args(host="0.0.0.0", port=9300, insecure_no_auth=True))
    assert (open_config.host, open_config.port, open_config.insecure_no_auth) == ("0.0.0.0", 9300, True)
    assert "WARNING" in _auth_lines(open_config)["auth"]
    assert _auth_lines(load_config(args()))["auth"] == ""
    with pytest.raises(SystemExit, match="--insecure-no-auth"):
        load_config(args(host="10.0.0.5"))
    monkeypatch.setenv(API_KEY_ENV, KEY)
    keyed = load_config(args(host="0.0.0.0"))
    assert keyed.client_api_key() == KEY
    assert KEY not in json.dumps(_auth_lines(keyed)) and "$PDCLUSTER_API_KEY" in _auth_lines(keyed)["curl_auth"]
