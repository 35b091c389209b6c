"""Transfer backends by name.  ``create_backend("auto")`` takes NIXL when it
imports and initialises here and falls back to the portable socket backend
otherwise (unless ``allow_fallback=False``: then it fails loudly, as a named
backend that cannot start always does).

``internal_host`` is the address the peer serves on and advertises
(pdcluster.transfer.address): the socket backend's block server binds it, NIXL's UCX
uses the device that holds it; a non-loopback one needs the cluster secret.

The interface is pdcluster.transfer.base; this module is the explicit table of the
backends and imports them, nothing imports it back.  A new backend:
subclass ``TransferBackend`` in its own module, add the class to ``BACKENDS``."""

from __future__ import annotations

import logging
from typing import Any

from pdcluster.transfer.address import check_exposure, device_of
from pdcluster.transfer.base import TransferBackend
from pdcluster.transfer.errors import BackendUnavailableError
from pdcluster.transfer.nixl_backend import NixlBackend
from pdcluster.transfer.socket_backend import SocketBackend

log = logging.getLogger("pdcluster.transfer")

BACKENDS: dict[str, type[TransferBackend]] = {cls.name: cls for cls in (NixlBackend, SocketBackend)}
AUTO_ORDER = ("nixl", "fallback")


def backend_names() -> list[str]:
    return sorted(BACKENDS)


def backend_class(name: str) -> type[TransferBackend]:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown transfer backend {name!r}; choose one of {backend_names()} or 'auto'") from None


def create_backend(name: str = "auto", *, secret: bytes | None = None, internal_host: str | None = None,
                   allow_fallback: bool = True, **options: Any) -> TransferBackend:
    """A new backend; ``secret`` is the cluster's (>= 16 bytes, the same on every
    replica: the serving layer always passes one, see pdcluster.transfer.base), and
    ``options`` go to its constructor (peer_id, timeout_s, ...)."""
    if internal_host is not None:
        check_exposure(internal_host, secret)
    if name != "auto":
        cls = backend_class(name)
        return cls(secret=secret, **_transport_options(cls, internal_host), **options)
    failures = []
    for candidate in AUTO_ORDER if allow_fallback else AUTO_ORDER[:1]:
        cls = backend_class(candidate)
        try:
            backend = cls(secret=secret, **_transport_options(cls, internal_host), **options)
        except BackendUnavailableError as e:
            failures.append(f"{candidate}: {e}")
            continue
        if failures:
            log.warning("kv transfer backend auto-picked %s; unavailable: %s", candidate, "; ".join(failures))
        return backend
    if not allow_fallback:
        raise BackendUnavailableError("NIXL cannot start and falling back to the socket backend is not allowed "
                                      "(topology.allow_transfer_fallback: false): " + "; ".join(failures))
    raise BackendUnavailableError("no transfer backend could start: " + "; ".join(failures))


def _transport_options(cls: type[TransferBackend], internal_host: str | None) -> dict[str, Any]:
    """Where ``cls`` serves: a listener binds the host, NIXL's UCX takes its device."""
    if internal_host is None:
        return {}
    device = device_of(internal_host)  # also: the address is this host's own, or it fails here, loudly
    return {"host": internal_host} if cls.needs_listener else {"net_devices": device}
