"""What one side tells the other: the peer descriptor (once per peer and
epoch) and the notification that follows a pull (once per pull).

A descriptor names a pool: who owns it (``peer_id``, stable across restarts,
and ``epoch``, new on every start), how its blocks look (``layout``), and how
to reach it (``agent_metadata`` + ``pool_addr`` for NIXL, ``endpoint`` for the
socket fallback).  The puller caches what a descriptor costs to set up and
re-handshakes when the epoch changes.

With a cluster secret the owner signs the descriptor (``signature``, the MAC
of ``body()``) and the puller checks it before using a field of it; a
release notification carries a tag the owner checks (pdcluster.transfer.auth)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from pdcluster.transfer.errors import TransferError
from pdcluster.transfer.layout import KVLayout
from pdcluster.transfer.wire import MAX_DESCRIPTOR_BYTES, MAX_NOTIFICATION_BYTES, pack, unpack

_PEER_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")
_MAX_U64 = 2**64 - 1
MAX_LEASE_ID_CHARS = 256


def check_peer_id(peer_id: str) -> str:
    if not isinstance(peer_id, str) or not _PEER_ID.match(peer_id):
        raise ValueError(f"peer_id must be 1-128 of [A-Za-z0-9_.:@-], got {peer_id!r}")
    return peer_id


def agent_name(peer_id: str, epoch: int) -> str:
    """Unique per process start: NIXL refuses two agents of one name."""
    return f"{peer_id}#{epoch:016x}"


def peer_id_of_agent(name: str) -> str:
    return name.rsplit("#", 1)[0]


@dataclass(frozen=True)
class PeerDescriptor:
    backend: str  # registry name of the backend that must pull from it
    peer_id: str
    epoch: int
    layout: KVLayout
    num_blocks: int
    mem_type: str = "DRAM"  # "DRAM" or "VRAM"
    device_id: int = 0
    pool_addr: int = 0  # nixl: address of block 0 in the owner's address space
    agent_metadata: bytes = b""  # nixl: nixl_agent.get_agent_metadata()
    endpoint: str = ""  # fallback: "host:port" of the owner's block server
    signature: bytes = field(default=b"", compare=False, repr=False)  # MAC of body(); b"" when unsigned

    def __post_init__(self) -> None:
        check_peer_id(self.peer_id)
        _require(isinstance(self.backend, str) and self.backend, "backend", self.backend)
        for name in ("epoch", "num_blocks", "device_id", "pool_addr"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_U64,
                     name, value)
        _require(self.num_blocks > 0, "num_blocks", self.num_blocks)
        _require(self.mem_type in ("DRAM", "VRAM"), "mem_type", self.mem_type)
        _require(isinstance(self.agent_metadata, bytes), "agent_metadata", type(self.agent_metadata))
        _require(isinstance(self.endpoint, str) and len(self.endpoint) <= 300, "endpoint", self.endpoint)
        _require(isinstance(self.signature, bytes) and len(self.signature) <= 64, "signature", len(self.signature))

    @property
    def agent_name(self) -> str:
        return agent_name(self.peer_id, self.epoch)

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def body(self) -> bytes:
        """The encoding without the signature: what the signature covers."""
        return pack(self._fields())

    def encode(self) -> bytes:
        return pack({**self._fields(), "sig": self.signature}) if self.signature else self.body()

    def signed(self, signature: bytes) -> PeerDescriptor:
        return replace(self, signature=signature)

    def _fields(self) -> dict[str, Any]:
        fields = {k: getattr(self, k) for k in _FIELDS}
        fields["layout"] = self.layout.to_dict()
        return {"v": 1, **fields}

    @classmethod
    def decode(cls, data: bytes) -> PeerDescriptor:
        obj = unpack(data, MAX_DESCRIPTOR_BYTES, "peer descriptor")
        if not isinstance(obj, dict) or obj.get("v") != 1:
            raise TransferError("peer descriptor has no version 1 header; both sides must run the same pdcluster")
        missing = [k for k in _FIELDS if k not in obj]
        if missing:
            raise TransferError(f"peer descriptor lacks {missing}; both sides must run the same pdcluster")
        try:
            layout = KVLayout.from_dict(obj["layout"])
            return cls(**{k: obj[k] for k in _FIELDS if k != "layout"}, layout=layout,
                       signature=obj.get("sig", b""))
        except (TypeError, ValueError) as e:
            raise TransferError(f"malformed peer descriptor: {e}") from e


_FIELDS = ("backend", "peer_id", "epoch", "layout", "num_blocks", "mem_type", "device_id",
           "pool_addr", "agent_metadata", "endpoint")


def _require(ok: Any, name: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"peer descriptor field {name} is invalid: {value!r:.100}")


@dataclass(frozen=True)
class Notification:
    """A puller finished pulling the blocks it was lent under ``lease_id``:
    the owner may release them (LeaseTable.release)."""

    from_peer: str
    lease_id: str
    tag: bytes | None = field(default=None, compare=False, repr=False)  # the sender's MAC, checked by the owner


def check_lease_id(lease_id: str) -> str:
    if not isinstance(lease_id, str) or not 0 < len(lease_id) <= MAX_LEASE_ID_CHARS:
        raise ValueError(f"lease_id must be a non-empty str of at most {MAX_LEASE_ID_CHARS} chars, "
                         f"got {lease_id!r:.300}")
    return lease_id


def encode_notification(lease_id: str, tag: bytes | None = None) -> bytes:
    check_lease_id(lease_id)
    return pack({"lease": lease_id} if tag is None else {"lease": lease_id, "tag": tag})


def decode_notification(from_peer: str, data: bytes) -> Notification:
    """The notification, its tag unchecked; errors never quote the (untrusted) payload."""
    obj = unpack(data, MAX_NOTIFICATION_BYTES, f"notification from {from_peer!r:.140}")
    if not isinstance(obj, dict) or not isinstance(obj.get("lease"), str):
        raise TransferError(f"notification from {from_peer!r:.140} carries no lease id")
    tag = obj.get("tag")
    return Notification(from_peer, obj["lease"], tag if isinstance(tag, bytes) else None)
