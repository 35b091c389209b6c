"""The address a KV peer binds and advertises, and the network device that
carries it.  Knows nothing of the serving layer: the caller says which host.

    one host      127.0.0.1     block server on 127.0.0.1, UCX_NET_DEVICES=lo
    many hosts    10.0.0.12     block server on 10.0.0.12 (what the descriptor
                                advertises), UCX on the device holding it (eth0)

A non-loopback address carries KV over a network: without the cluster secret
every peer that reaches it would be served, so it is refused."""

from __future__ import annotations

import ipaddress
import socket

from pdcluster.transfer.errors import BackendUnavailableError

LOOPBACK_DEVICE = "lo"


def is_loopback_address(host: str) -> bool:
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def device_of(host: str) -> str:
    """The network interface that holds ``host`` here (``lo`` for loopback);
    raises BackendUnavailableError naming the addresses this host has."""
    if is_loopback_address(host):
        return LOOPBACK_DEVICE
    import psutil

    interfaces = psutil.net_if_addrs()
    for name, addresses in interfaces.items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == host
               for a in addresses):
            return name
    have = sorted({a.address for addrs in interfaces.values() for a in addrs
                   if a.family in (socket.AF_INET, socket.AF_INET6)})
    raise BackendUnavailableError(f"no network interface here holds {host} (this host has {', '.join(have)}): "
                                  "set the internal address to one of this host's own, or `node`")


def check_exposure(host: str, secret: bytes | None) -> None:
    """Refuses to serve KV blocks on a network address without the cluster secret."""
    if secret is None and not is_loopback_address(host):
        raise BackendUnavailableError(
            f"refusing to serve KV blocks on {host} without the cluster secret: any host that reaches it could "
            "read or forge KV.  Give every node the same PDCLUSTER_CLUSTER_SECRET "
            "(`python -c 'import secrets; print(secrets.token_hex(32))'`), or keep the internal address on loopback")
