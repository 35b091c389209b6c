"""The token channel: one TCP connection from an engine replica to a gateway
replica's token inbox, carrying the deltas of every stream that replica
serves for that gateway.  Ray Serve keeps each call (routing, cancellation,
errors, a dead replica); only the per-token items leave its streaming path,
which cost each token ~0.5 ms of CPU on either side (bench/README.md, "A lone
stream's time").

Frames are a 4-byte big-endian length and a msgpack body.  The connection
opens with a mutual challenge keyed by the cluster secret
(``ClusterSecret``, with labels beside pdcluster/transfer/auth.py's; importing
that module loads no transfer backend):

    inbox  -> {"op": "challenge", "nonce": sn, "inbox": id}
    sender -> {"op": "auth", "replica": r, "nonce": cn, "mac"}   HMAC("token-sender", sn, cn, r, id)
    inbox  -> {"ok": true, "mac"}                                HMAC("token-inbox",  sn, cn, r, id)

then delta frames only (pdcluster/services/delta_wire.py).  Without a secret
the macs are left out (tests): a frame still needs its attempt's random key
to reach a stream, and it is decoded as typed fields, never unpickled."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

from pdcluster.transfer.auth import ClusterSecret, is_nonce, new_nonce

HEADER = struct.Struct(">I")
TOKEN_SENDER_PROOF = "token-sender"   # labels beside the transfer layer's (pdcluster/transfer/auth.py):
TOKEN_INBOX_PROOF = "token-inbox"     # a tag made for one purpose is never accepted for another
HANDSHAKE_BYTES = 1024
HANDSHAKE_TIMEOUT_S = 5.0


class ChannelRefused(ConnectionError):
    """The other side failed the challenge, or spoke something else."""


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    """One frame's body; ChannelRefused when it announces more than ``max_bytes``
    (the stream is unusable after), IncompleteReadError at EOF."""
    (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if length > max_bytes:
        raise ChannelRefused(f"a frame of {length} bytes, over the {max_bytes}-byte limit")
    return await reader.readexactly(length)


async def _read_message(reader: asyncio.StreamReader) -> dict:
    try:
        message = msgpack.unpackb(await read_frame(reader, HANDSHAKE_BYTES), raw=False, max_ext_len=0)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ChannelRefused(f"a handshake frame that is not msgpack ({exc})") from exc
    if not isinstance(message, dict):
        raise ChannelRefused("a handshake frame that is not a map")
    return message


def _send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(frame(msgpack.packb(message, use_bin_type=True)))


async def challenge_sender(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           secret: ClusterSecret | None, inbox_id: str) -> str:
    """Inbox side: the replica's name once it proved it holds the secret; ChannelRefused otherwise
    (the caller closes the connection)."""
    server_nonce = new_nonce()
    _send(writer, {"op": "challenge", "nonce": server_nonce, "inbox": inbox_id})
    auth = await _read_message(reader)
    replica, nonce = auth.get("replica"), auth.get("nonce")
    if auth.get("op") != "auth" or not isinstance(replica, str) or not replica or not is_nonce(nonce):
        raise ChannelRefused("a malformed auth frame")
    if secret is not None and not secret.verify(auth.get("mac"), TOKEN_SENDER_PROOF, server_nonce, nonce,
                                                replica, inbox_id):
        raise ChannelRefused(f"{replica!r} failed the challenge (another cluster's secret?)")
    reply: dict[str, Any] = {"ok": True}
    if secret is not None:
        reply["mac"] = secret.mac(TOKEN_INBOX_PROOF, server_nonce, nonce, replica, inbox_id)
    _send(writer, reply)
    await writer.drain()
    return replica


async def answer_challenge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           secret: ClusterSecret | None, replica: str, inbox_id: str) -> None:
    """Sender side: proves this replica holds the secret and checks that the inbox does, and that it
    is the inbox the call named; ChannelRefused otherwise."""
    challenge = await _read_message(reader)
    server_nonce = challenge.get("nonce")
    if challenge.get("op") != "challenge" or not is_nonce(server_nonce) or challenge.get("inbox") != inbox_id:
        raise ChannelRefused(f"the peer is not token inbox {inbox_id}")
    nonce = new_nonce()
    auth: dict[str, Any] = {"op": "auth", "replica": replica, "nonce": nonce}
    if secret is not None:
        auth["mac"] = secret.mac(TOKEN_SENDER_PROOF, server_nonce, nonce, replica, inbox_id)
    _send(writer, auth)
    await writer.drain()
    reply = await _read_message(reader)
    if reply.get("ok") is not True or (secret is not None and not secret.verify(
            reply.get("mac"), TOKEN_INBOX_PROOF, server_nonce, nonce, replica, inbox_id)):
        raise ChannelRefused(f"token inbox {inbox_id} refused this replica or failed its own proof")
