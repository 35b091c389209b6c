"""The messages of a pull the owner serves as a WRITE (pdcluster.transfer.nixl_writer),
carried as NIXL notifications between the two agents:

    puller -> owner   {"op": "write", "seq", "lease", "runs", "ttl", "puller", "tag"}
    owner  -> puller  the WRITE into the puller's blocks, its NIXL notification
                      {"op": "wrote", "seq", "ok": true, "tag"} sent once the bytes landed
                    | {"op": "wrote", "seq", "ok": false, "code", "error", "tag"}  nothing written
    puller -> owner   {"op": "cancel", "seq", "tag"}   the puller gave up: do not start, or stop
    puller -> owner   {"op": "ping"}   while waiting, every PING_INTERVAL_S: ignored by the owner,
                      but sending it fails at once when the owner's host reset the connection

``runs`` are [owner block, puller block, count] triples; ``puller`` is the
puller's own signed PeerDescriptor (where its pool lies, its agent metadata);
``ttl`` is a time-to-live, not a time of day: the seconds the owner may spend
on the request, counted on the owner's own monotonic clock from the moment it
received it (pdcluster.transfer.nixl_writer).  The owner starts nothing after that and
cancels what runs past it; the puller sets it to its remaining wait less a
margin that covers the request's transit and the owner's routing delay
(pdcluster.transfer.nixl_write_puller), so no byte lands in blocks the puller has freed.
No clock of one host is ever compared with the other's: a skew between them
changes nothing here.

    puller  sent                                             gives up, frees its blocks
            |<------------------- remaining wait ------------------>|
    owner   |<- delay ->|<------------- ttl ------------->| stops   |
                     receipt           (ttl = remaining wait - margin)
    the owner stops first while the delay (transit + routing) < the margin

With a cluster secret every message carries an HMAC tag (pdcluster.transfer.auth) over
all its fields and both agents' names (which hold their epochs): a message is
valid only between these two incarnations, and ``seq`` (increasing per puller)
lets the owner refuse a replayed request (pdcluster.transfer.replay_window).  A replay
would get a fresh ttl at its new receipt: the replay window and, on a guarded
owner, the lease refuse it, not a clock."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdcluster.transfer.auth import WRITE_CANCEL, WRITE_DONE, WRITE_REQUEST, ClusterSecret
from pdcluster.transfer.errors import TransferError
from pdcluster.transfer.peer import MAX_LEASE_ID_CHARS
from pdcluster.transfer.runs import BlockRun
from pdcluster.transfer.wire import MAX_DESCRIPTOR_BYTES, pack, unpack

MAX_ERROR_CHARS = 500
MAX_TTL_S = 600.0  # a request's longest time-to-live: far above any pull's timeout
PING = pack({"op": "ping"})
PING_INTERVAL_S = 0.1
_RUN_BYTES = 1 + 3 * 9  # a msgpack [owner, puller, count] triple of uint64s, at most


def max_message_bytes(num_blocks: int) -> int:
    """The largest write-path message an owner of ``num_blocks`` blocks accepts:
    a request with one run per block, the puller's descriptor and a lease id."""
    return 1024 + MAX_DESCRIPTOR_BYTES + 4 * MAX_LEASE_ID_CHARS + num_blocks * _RUN_BYTES


@dataclass(frozen=True)
class WriteRequest:
    seq: int
    lease_id: str | None
    runs: tuple[BlockRun, ...]  # remote_start = owner's block, local_start = puller's block
    ttl_s: float  # seconds the owner may spend on it, from its own receipt (see the module)
    puller: bytes  # the puller's encoded, signed PeerDescriptor
    tag: bytes | None = None

    def __post_init__(self) -> None:
        if not valid_ttl(self.ttl_s):
            raise ValueError(f"ttl_s must be a finite float in (0, {MAX_TTL_S:g}], got {self.ttl_s!r}")

    def fields(self) -> list[Any]:
        return [self.seq, self.lease_id, [[r.remote_start, r.local_start, r.num_blocks] for r in self.runs],
                self.ttl_s, self.puller]

    def encode(self) -> bytes:
        seq, lease, runs, ttl, puller = self.fields()
        return pack({"op": "write", "seq": seq, "lease": lease, "runs": runs, "ttl": ttl,
                     "puller": puller, "tag": self.tag})


def valid_ttl(ttl_s: Any) -> bool:
    return type(ttl_s) is float and math.isfinite(ttl_s) and 0.0 < ttl_s <= MAX_TTL_S


@dataclass(frozen=True)
class WriteDone:
    seq: int
    ok: bool
    code: str = ""  # "" | "lease_expired" | "lease_required" | "refused" | "expired" | "failed"
    error: str = ""
    tag: bytes | None = None

    def fields(self) -> list[Any]:
        return [self.seq, self.ok, self.code, self.error]

    def encode(self) -> bytes:
        return pack({"op": "wrote", "seq": self.seq, "ok": self.ok, "code": self.code,
                     "error": self.error[:MAX_ERROR_CHARS], "tag": self.tag})


@dataclass(frozen=True)
class WriteCancel:
    seq: int
    tag: bytes | None = None

    def encode(self) -> bytes:
        return pack({"op": "cancel", "seq": self.seq, "tag": self.tag})


Message = WriteRequest | WriteDone | WriteCancel


def sign_request(req: WriteRequest, secret: ClusterSecret | None, puller_agent: str, owner_agent: str) -> WriteRequest:
    tag = None if secret is None else secret.mac(WRITE_REQUEST, puller_agent, owner_agent, *req.fields())
    return WriteRequest(req.seq, req.lease_id, req.runs, req.ttl_s, req.puller, tag)


def sign_done(done: WriteDone, secret: ClusterSecret | None, owner_agent: str, puller_agent: str) -> WriteDone:
    tag = None if secret is None else secret.mac(WRITE_DONE, owner_agent, puller_agent, *done.fields())
    return WriteDone(done.seq, done.ok, done.code, done.error[:MAX_ERROR_CHARS], tag)


def sign_cancel(seq: int, secret: ClusterSecret | None, puller_agent: str, owner_agent: str) -> WriteCancel:
    return WriteCancel(seq, None if secret is None else secret.mac(WRITE_CANCEL, puller_agent, owner_agent, seq))


def verify(msg: Message, secret: ClusterSecret | None, sender_agent: str, receiver_agent: str) -> bool:
    """True without a secret; with one, when ``msg``'s tag is the MAC its sender had to make."""
    if secret is None:
        return True
    if isinstance(msg, WriteRequest):
        return secret.verify(msg.tag, WRITE_REQUEST, sender_agent, receiver_agent, *msg.fields())
    if isinstance(msg, WriteDone):
        return secret.verify(msg.tag, WRITE_DONE, sender_agent, receiver_agent, *msg.fields())
    return secret.verify(msg.tag, WRITE_CANCEL, sender_agent, receiver_agent, msg.seq)


def is_write_message(obj: Any) -> bool:
    """A message of the write path (ping included); anything else is a lease release."""
    return isinstance(obj, dict) and obj.get("op") in ("write", "wrote", "cancel", "ping")


def decode(obj: dict[str, Any], sender: str) -> Message:
    """A write-path message from an unpacked notification (is_write_message(obj));
    TransferError, never quoting the payload, when a field is malformed."""
    try:
        op, seq, tag = obj["op"], obj["seq"], obj.get("tag")
        _need(type(seq) is int and 0 < seq < 2**63, "seq")
        _need(tag is None or isinstance(tag, bytes), "tag")
        if op == "cancel":
            return WriteCancel(seq, tag)
        if op == "wrote":
            ok, code, error = obj["ok"], obj.get("code", ""), obj.get("error", "")
            _need(type(ok) is bool and isinstance(code, str) and isinstance(error, str), "status")
            return WriteDone(seq, ok, code[:40], error[:MAX_ERROR_CHARS], tag)
        lease, ttl, puller = obj["lease"], obj["ttl"], obj["puller"]
        _need(lease is None or (isinstance(lease, str) and 0 < len(lease) <= MAX_LEASE_ID_CHARS), "lease")
        _need(valid_ttl(ttl), "ttl")
        _need(isinstance(puller, bytes) and len(puller) <= MAX_DESCRIPTOR_BYTES, "puller")
        return WriteRequest(seq, lease, _runs(obj["runs"]), ttl, puller, tag)
    except (KeyError, TypeError, ValueError) as e:
        raise TransferError(f"malformed write-path message from {sender!r:.140}: {e}") from None


def unpack_notification(payload: bytes, max_bytes: int, sender: str) -> Any:
    return unpack(payload, max_bytes, f"notification from {sender!r:.140}")


def _runs(raw: Any) -> tuple[BlockRun, ...]:
    _need(isinstance(raw, list) and raw, "runs")
    out = []
    for item in raw:
        _need(isinstance(item, list) and len(item) == 3 and all(type(x) is int for x in item), "run")
        out.append(BlockRun(*item))  # ValueError on negative starts or an empty run
    return tuple(out)


def _need(ok: bool, field: str) -> None:
    if not ok:
        raise ValueError(f"field {field} is invalid")
