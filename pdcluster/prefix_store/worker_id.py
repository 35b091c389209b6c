"""A worker's identity in the prefix index: a stable name plus an epoch.

The name is what the router knows a replica by (by default the Serve replica
id); the epoch changes every time the worker's engine starts, so entries a
previous incarnation published can never be mistaken for what the new one
holds.  The wire form is ``"<name>@<epoch>"``.

Epochs are integers below 2**53 so Redis' Lua (doubles) compares them
exactly; the default is the start time in microseconds, which grows across
restarts on one host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

MAX_EPOCH = 2**53 - 1


@dataclass(frozen=True, order=True)
class WorkerId:
    name: str
    epoch: int

    def __post_init__(self) -> None:
        if not self.name or "@" in self.name or "{" in self.name or "}" in self.name:
            raise ValueError(
                f"worker name {self.name!r} must be non-empty and contain no '@', '{{' or '}}': "
                "use the Serve replica id or a host:pid string")
        if not 0 <= self.epoch <= MAX_EPOCH:
            raise ValueError(f"epoch {self.epoch} must be in [0, 2**53): use WorkerId.new(name)")

    @classmethod
    def new(cls, name: str) -> "WorkerId":
        """A fresh incarnation of ``name`` (epoch = now in microseconds)."""
        return cls(name, time.time_ns() // 1000)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.epoch}"

    @classmethod
    def parse(cls, key: str | bytes) -> "WorkerId":
        text = key.decode() if isinstance(key, bytes) else key
        name, sep, epoch = text.rpartition("@")
        if not sep:
            raise ValueError(f"worker key {text!r} is not '<name>@<epoch>'")
        return cls(name, int(epoch))

    def __str__(self) -> str:
        return self.key
