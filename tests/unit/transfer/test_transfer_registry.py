"""Backend registry: names, capability flags, auto-pick and its fallback."""

import pytest

import pdcluster.transfer.nixl_backend as nixl_backend
from pdcluster.transfer import BackendUnavailableError, backend_class, backend_names, create_backend
from pdcluster.transfer.socket_backend import SocketBackend


def test_builtin_backends_are_registered_with_capabilities():
    assert {"nixl", "fallback"} <= set(backend_names())
    for name in ("nixl", "fallback"):
        cls = backend_class(name)
        assert all(isinstance(getattr(cls, flag), bool) for flag in ("one_sided", "device_memory", "needs_listener"))
    assert backend_class("nixl").one_sided and not backend_class("fallback").one_sided


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown transfer backend 'rdma'; choose one of \['fallback', 'nixl'\]"):
        create_backend("rdma")


def test_auto_picks_nixl_when_it_starts():
    with create_backend("auto", peer_id="auto-test") as backend:
        assert backend.name == "nixl"


def test_auto_falls_back_when_nixl_is_unavailable(monkeypatch, caplog):
    def broken():
        raise BackendUnavailableError("nixl does not import here (ImportError: test)")

    monkeypatch.setattr(nixl_backend, "_load_nixl", broken)
    with create_backend("auto", peer_id="auto-test", timeout_s=2.0) as backend:
        assert isinstance(backend, SocketBackend) and backend.timeout_s == 2.0
    assert "auto-picked fallback" in caplog.text and "ImportError: test" in caplog.text
    with pytest.raises(BackendUnavailableError, match="ImportError: test"):
        create_backend("nixl")  # asked for by name: no silent substitute
