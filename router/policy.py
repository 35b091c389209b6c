"""Routing policy interface and registry.

A policy turns a ``RoutingSnapshot`` into a ``RoutingDecision`` and does no
I/O.  Policies may keep tiny private state (a round-robin turn, an RNG) but
the rule itself lives in a pure module-level function beside each class.

Capability flag: ``uses_prefix_index`` -- the router queries the global
prefix index (one round trip) only for policies that set it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from router.snapshot import RoutingDecision, RoutingSnapshot

_POLICIES: dict[str, type["RoutingPolicy"]] = {}


class RoutingPolicy(ABC):
    name: ClassVar[str]
    uses_prefix_index: ClassVar[bool] = False

    @abstractmethod
    def choose(self, snapshot: RoutingSnapshot) -> RoutingDecision: ...

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            _POLICIES[cls.name] = cls


def _load_builtin_policies() -> None:
    import router.cache_aware  # noqa: F401  (each import registers its policy)
    import router.decode_policy  # noqa: F401
    import router.least_loaded  # noqa: F401
    import router.round_robin  # noqa: F401


def make_policy(name: str, **options) -> RoutingPolicy:
    _load_builtin_policies()
    if name not in _POLICIES:
        raise ValueError(f"routing policy {name!r} is unknown: use one of {sorted(_POLICIES)}")
    return _POLICIES[name](**options)


def policy_names() -> list[str]:
    _load_builtin_policies()
    return sorted(_POLICIES)
