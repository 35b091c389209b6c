"""Routing policies by name: ``make_policy("cache_aware", **options)``.

The interface is pdcluster.router.policy_base (re-exported here); this module is the
explicit table of the built-in policies and imports them, nothing imports
it back.  A new policy: subclass ``RoutingPolicy`` in its own module, add
the class to ``POLICIES``.
"""

from __future__ import annotations

from pdcluster.router.cache_aware import CacheAwarePolicy
from pdcluster.router.decode_policy import DecodeByKVPolicy
from pdcluster.router.least_loaded import LeastLoadedPolicy
from pdcluster.router.policy_base import RoutingPolicy
from pdcluster.router.round_robin import RoundRobinPolicy

__all__ = ["POLICIES", "RoutingPolicy", "make_policy", "policy_names"]

POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (CacheAwarePolicy, DecodeByKVPolicy, LeastLoadedPolicy, RoundRobinPolicy)
}


def make_policy(name: str, **options) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"routing policy {name!r} is unknown: use one of {sorted(POLICIES)}")
    return POLICIES[name](**options)


def policy_names() -> list[str]:
    return sorted(POLICIES)
