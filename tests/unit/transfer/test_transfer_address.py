"""Where a KV peer serves: the socket backend binds the internal address and
advertises it, NIXL takes the device that holds it; a network address needs
the cluster secret and must be this host's own; `auto` without fallback
fails loudly."""

import pytest
import torch

from pdcluster.transfer import KVLayout, create_backend
from pdcluster.transfer.address import check_exposure, device_of, is_loopback_address
from pdcluster.transfer.errors import BackendUnavailableError

SECRET = b"s" * 32
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", block_size=2, model_fingerprint=7)


def test_loopback_is_device_lo_and_needs_no_secret():
    assert is_loopback_address("127.0.0.1") and is_loopback_address("::1") and not is_loopback_address("10.0.0.1")
    assert device_of("127.0.0.1") == "lo"
    check_exposure("127.0.0.1", None)


def test_a_network_address_needs_the_secret_and_must_be_ours():
    with pytest.raises(BackendUnavailableError, match="without the cluster secret"):
        create_backend("fallback", internal_host="10.99.99.99")
    with pytest.raises(BackendUnavailableError, match="no network interface here holds 10.99.99.99"):
        create_backend("fallback", internal_host="10.99.99.99", secret=SECRET)


def test_socket_backend_advertises_the_internal_address():
    backend = create_backend("fallback", secret=SECRET, internal_host="127.0.0.1")
    try:
        backend.register_pool(torch.zeros(4, *LAYOUT.block_shape), LAYOUT)
        assert backend.server.endpoint.startswith("127.0.0.1:")
        assert b"127.0.0.1:" in backend.describe()  # what pullers are told to connect to
    finally:
        backend.close()


def test_auto_without_fallback_fails_loudly_when_nixl_cannot_start(monkeypatch):
    import pdcluster.transfer.nixl_backend as nixl_backend

    def broken():
        raise BackendUnavailableError("nixl does not import here (test)")

    monkeypatch.setattr(nixl_backend, "_load_nixl", broken)
    with pytest.raises(BackendUnavailableError, match="falling back to the socket backend is not allowed"):
        create_backend("auto", secret=SECRET, internal_host="127.0.0.1", allow_fallback=False)
    fallback = create_backend("auto", secret=SECRET, internal_host="127.0.0.1")  # allowed: counted and warned
    try:
        assert fallback.name == "fallback"
    finally:
        fallback.close()
