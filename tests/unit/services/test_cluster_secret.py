"""The per-cluster KV-peer secret: made up once unless the operator set one,
read back as bytes, malformed values refused without being echoed, and never
in the runtime_env Ray logs."""

import pytest

from pdcluster.services.cluster_env import replica_env
from pdcluster.services.cluster_secret import CLUSTER_SECRET_ENV, cluster_secret, ensure_cluster_secret


def test_ensure_makes_one_up_once_and_cluster_secret_reads_it_back(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    assert cluster_secret() is None
    assert ensure_cluster_secret() is True
    secret = cluster_secret()
    assert isinstance(secret, bytes) and len(secret) == 32
    assert ensure_cluster_secret() is False and cluster_secret() == secret  # stable once set


def test_an_operator_secret_wins(monkeypatch):
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "ab" * 16)
    assert ensure_cluster_secret() is False
    assert cluster_secret() == b"\xab" * 16


@pytest.mark.parametrize("value, message", [("not-hex-at-all-zz", "is not hex"), ("abcd", "holds 2 bytes")])
def test_a_malformed_secret_is_refused_without_echoing_it(monkeypatch, value, message):
    monkeypatch.setenv(CLUSTER_SECRET_ENV, value)
    with pytest.raises(ValueError, match=message) as err:
        cluster_secret()
    assert value not in str(err.value)
    with pytest.raises(ValueError):
        ensure_cluster_secret()


def test_the_secret_never_travels_in_the_runtime_env(monkeypatch):
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "cd" * 32)
    assert CLUSTER_SECRET_ENV not in replica_env() and "cd" * 32 not in replica_env().values()
