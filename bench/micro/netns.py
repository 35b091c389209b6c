"""Two "hosts" on one machine: two network namespaces joined by a veth pair
(root and iproute2 needed), for the multi-host test and `bench.micro.transfer_speed
--two-hosts`.

    netns pdcA-xxxx                      netns pdcB-xxxx
      lo 127.0.0.1                         lo 127.0.0.1
      vA-xxxx 10.213.N.1/24  <── veth ──>  vB-xxxx 10.213.N.2/24

Everything is removed on exit (deleting a namespace deletes its veth end,
and with it the pair), also when setting up fails half-way."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class HostPair:
    ns_a: str
    ns_b: str
    ip_a: str
    ip_b: str
    dev_a: str
    dev_b: str

    def exec_prefix(self, ns: str) -> list[str]:
        """Runs a command inside ``ns``: ``[*prefix, *command]``."""
        return ["ip", "netns", "exec", ns]

    def tx_bytes(self, ns: str, dev: str) -> int:
        """Bytes ``dev`` (in ``ns``) has sent, from the kernel's counters."""
        out = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", dev], check=True,
                             capture_output=True, text=True).stdout
        import json

        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def unavailable_reason() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"pdcP-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[HostPair]:
    tag = secrets.token_hex(3)
    subnet = f"10.213.{secrets.randbelow(200) + 20}"
    pair = HostPair(f"pdcA-{tag}", f"pdcB-{tag}", f"{subnet}.1", f"{subnet}.2", f"vA-{tag}", f"vB-{tag}")
    made: list[str] = []
    try:
        for ns in (pair.ns_a, pair.ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", pair.dev_a, "type", "veth", "peer", "name", pair.dev_b)
        for ns, dev, ip in ((pair.ns_a, pair.dev_a, pair.ip_a), (pair.ns_b, pair.dev_b, pair.ip_b)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield pair
    finally:
        subprocess.run(["ip", "link", "del", pair.dev_a], capture_output=True)  # if never moved
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
