"""Who moves the bytes of a NIXL pull: the puller READs them, or it asks the
owner to WRITE them (pdcluster.transfer.nixl_writer).  Measured on a 2-core host (nixl
1.5.1, SmolLM2 blocks of 360 KiB, fragmented lists, medians; Dec 1):

    UCX on one host, shared memory (cma)   READ: one-sided, no round trip to the
      bench.micro.transfer_speed           owner's ticker.  256 blocks: READ 4.91
                                           GB/s, WRITE 4.04; 1 block: 0.31 ms vs 1.99
    UCX over TCP (between hosts, or        READ is emulated with active messages
    UCX_TLS=tcp)                           the owner's CPU must serve; a WRITE is
      ... --two-hosts (veth)               a zero-copy send from the owner.  256
                                           blocks: WRITE 1.59 GB/s, READ 0.99, the
                                           socket fallback 1.51

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
