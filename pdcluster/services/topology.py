"""Cluster topology: which Ray nodes each pool runs on, and the address
the KV peers (and Redis) meet on when the cluster spans hosts.

    head node (ray start --head, pdcluster/role=head)    worker node (pdcluster join --role decode)
      gateway  :8000 on loopback unless keyed              decode replica
      prefill replica ──── KV blocks over internal_host ───► pulls from the prefill's advertised address
      Redis (password) on internal_host  ◄──────────────── prefix index, status board

Placement is Ray's own: a pool's ``node_selector`` becomes the replicas'
``label_selector`` (nodes carry labels from ``ray start --labels``), its
``resources`` Ray custom resources.  One host needs none of it."""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, model_validator

ROLE_LABEL = "pdcluster/role"
HEAD_LABEL = "pdcluster/head"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (also IPv4-mapped) and ``localhost``; no name is resolved."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolPlacement(_Strict):
    """Which Ray nodes one pool's replicas may run on."""
    node_selector: dict[str, str] = Field(
        {}, description="Ray node labels a replica's node must carry (Ray's label_selector; a node gets them from "
                        "`ray start --labels`, which `pdcluster join --role` sets as pdcluster/role=ROLE)")
    resources: dict[str, float] = Field({}, description="Ray custom resources one replica takes")



class TopologySettings(_Strict):
    """Where the pools run, and the address their KV peers meet on.

    ``internal_host`` is what each replica binds and advertises to its peers
    for KV transfer (the socket backend's block server; UCX's interface for
    NIXL): ``127.0.0.1`` keeps one host on loopback; ``node`` takes the Ray
    node's own address, so every replica of a multi-host cluster advertises
    the address of the host it runs on.  Anything but loopback needs the
    cluster secret (KV peers authenticate with it)."""
    internal_host: str = Field("127.0.0.1", description="127.0.0.1 | node | an IP address of this host")
    allow_transfer_fallback: bool = Field(
        True, description="transfer_backend auto may fall back to the socket backend when NIXL cannot start; "
                          "false: it fails loudly instead")
    gateway: PoolPlacement = PoolPlacement()
    prefill: PoolPlacement = PoolPlacement()
    decode: PoolPlacement = PoolPlacement()
    colocated: PoolPlacement = PoolPlacement()

    @model_validator(mode="after")
    def _check(self) -> "TopologySettings":
        from ray._private.label_utils import validate_label_selector

        if self.internal_host != "node" and not is_loopback(self.internal_host):
            try:
                ipaddress.ip_address(self.internal_host)
            except ValueError:
                raise ValueError(f"topology.internal_host {self.internal_host!r} is not an IP address: use "
                                 "127.0.0.1 (one host), node (each Ray node's address) or an address") from None
        for pool in ("gateway", "prefill", "decode", "colocated"):
            problem = validate_label_selector(getattr(self, pool).node_selector)
            if problem:
                raise ValueError(f"topology.{pool}.node_selector: {problem}")
        return self

    @property
    def spans_hosts(self) -> bool:
        return not is_loopback(self.internal_host)

    def internal_address(self) -> str:
        """The address this process's KV peer binds and advertises (in a
        replica, ``node`` is the Ray node it runs on)."""
        if self.internal_host != "node":
            return self.internal_host
        import ray

        return ray.util.get_node_ip_address()

    def actor_options(self, pool: str) -> dict:
        """The placement part of ``pool``'s ray_actor_options."""
        placement: PoolPlacement = getattr(self, pool)
        opts: dict = {}
        if placement.node_selector:
            opts["label_selector"] = dict(placement.node_selector)
        if placement.resources:
            opts["resources"] = dict(placement.resources)
        return opts


def internal_exposure_problem(topology: TopologySettings, index_url: str | None) -> str | None:
    """Why a cluster whose KV peers and Redis leave loopback would be open, or
    None.  The cluster secret (KV peers) is checked where the replicas start
    (pdcluster/services/cluster_secret.require_cluster_secret); here, the Redis URL."""
    if not topology.spans_hosts or not index_url or not index_url.startswith("redis"):
        return None
    from urllib.parse import urlsplit

    parts = urlsplit(index_url)
    if parts.password or (parts.username and not parts.password) or "password=" in parts.query:
        return None
    return ("topology.internal_host is not loopback, so Redis is reached over the network: give index_url a "
            "password (redis://:PASSWORD@HOST:PORT/0, from a secret), or leave index_url unset and let "
            "`pdcluster up --head` start a password-protected Redis on the internal address")


def multi_host_defaults() -> TopologySettings:
    """What `pdcluster up --head` assumes when the config says nothing: the
    gateway on the head, each pool on the nodes joined with its role, KV and
    Redis on each node's own address."""

    return TopologySettings(internal_host="node", gateway=PoolPlacement(node_selector={HEAD_LABEL: "true"}),
                            prefill=PoolPlacement(node_selector={ROLE_LABEL: "prefill"}),
                            decode=PoolPlacement(node_selector={ROLE_LABEL: "decode"}),
                            colocated=PoolPlacement(node_selector={ROLE_LABEL: "colocated"}))
