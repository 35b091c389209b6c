"""Transfer backends by name.  ``create_backend("auto")`` takes NIXL when it
imports and initialises here and falls back to the portable socket backend
otherwise; a named backend is taken as asked or fails loudly."""

from __future__ import annotations

import importlib
import logging
from typing import Any

from transfer.base import TransferBackend
from transfer.errors import BackendUnavailableError

log = logging.getLogger("pdcluster.transfer")

_BACKENDS: dict[str, type[TransferBackend]] = {}
_BUILTIN_MODULES = ("transfer.nixl_backend", "transfer.socket_backend")
AUTO_ORDER = ("nixl", "fallback")


def register_backend(cls: type[TransferBackend]) -> type[TransferBackend]:
    """Class decorator: makes ``cls`` creatable by its ``name``."""
    if cls.name in _BACKENDS and _BACKENDS[cls.name] is not cls:
        raise ValueError(f"transfer backend {cls.name!r} is already registered by {_BACKENDS[cls.name]}")
    _BACKENDS[cls.name] = cls
    return cls


def backend_names() -> list[str]:
    _load_builtins()
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[TransferBackend]:
    _load_builtins()
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown transfer backend {name!r}; choose one of {backend_names()} or 'auto'") from None


def create_backend(name: str = "auto", *, secret: bytes | None = None, **options: Any) -> TransferBackend:
    """A new backend; ``secret`` is the cluster's (>= 16 bytes, the same on every
    replica: the serving layer always passes one, see transfer.base), and
    ``options`` go to its constructor (peer_id, timeout_s, ...)."""
    if name != "auto":
        return backend_class(name)(secret=secret, **options)
    failures = []
    for candidate in AUTO_ORDER:
        try:
            backend = backend_class(candidate)(secret=secret, **options)
        except BackendUnavailableError as e:
            failures.append(f"{candidate}: {e}")
            continue
        if failures:
            log.warning("kv transfer backend auto-picked %s; unavailable: %s", candidate, "; ".join(failures))
        return backend
    raise BackendUnavailableError("no transfer backend could start: " + "; ".join(failures))


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
