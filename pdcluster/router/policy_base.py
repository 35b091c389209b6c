"""The routing policy interface.

A policy turns a ``RoutingSnapshot`` into a ``RoutingDecision`` and does no
I/O.  Policies may keep tiny private state (a round-robin turn, an RNG) but
the rule itself lives in a pure module-level function beside each class.

Capability flag: ``uses_prefix_index`` -- the router queries the global
prefix index (one round trip) only for policies that set it.

Each policy module imports this one; the table of policies by name is
pdcluster.router.policy, which imports the policies (nothing imports it back).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from pdcluster.router.snapshot import RoutingDecision, RoutingSnapshot


class RoutingPolicy(ABC):
    name: ClassVar[str]
    uses_prefix_index: ClassVar[bool] = False

    @abstractmethod
    def choose(self, snapshot: RoutingSnapshot) -> RoutingDecision: ...
