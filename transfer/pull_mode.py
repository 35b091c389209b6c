"""Who moves the bytes of a NIXL pull: the puller READs them, or it asks the
owner to WRITE them (transfer.nixl_writer).  Measured here (2-core host,
nixl 1.5.1, bench.micro.transfer_speed and its --two-hosts mode):

    UCX on one host, shared memory (cma)   READ: one-sided, no round trip to the
                                           owner's ticker; WRITE would add one
    UCX over TCP (between hosts, or        READ is emulated with active messages
    UCX_TLS=tcp)                           the owner's CPU must serve; a WRITE is
                                           a zero-copy send from the owner: WRITE

``choose_pull_mode`` is that rule as a pure function of the setting and the
environment UCX reads; "read" or "write" override it."""

from __future__ import annotations

from collections.abc import Mapping

PULL_MODES = ("auto", "read", "write")
_SHARED_MEMORY_TLS = ("all", "sm", "shm", "cma", "posix", "sysv", "xpmem", "knem")


def choose_pull_mode(setting: str, env: Mapping[str, str]) -> str:
    """"read" or "write" for ``setting`` ("auto" | "read" | "write") given UCX_NET_DEVICES and UCX_TLS."""
    if setting not in PULL_MODES:
        raise ValueError(f"pull_mode must be one of {PULL_MODES}, got {setting!r}")
    if setting != "auto":
        return setting
    devices = env.get("UCX_NET_DEVICES", "")
    tls = [t.strip().lstrip("^") for t in env.get("UCX_TLS", "").lower().split(",") if t.strip()]
    if env.get("UCX_TLS", "").strip().startswith("^"):  # all but these
        shared_memory = not any(t in ("sm", "shm", "cma") for t in tls)
    else:
        shared_memory = not tls or any(t in _SHARED_MEMORY_TLS for t in tls)
    return "read" if devices == "lo" and shared_memory else "write"
