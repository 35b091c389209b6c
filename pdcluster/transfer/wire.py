"""msgpack on the wire, never trusted: every decode is size-limited and every
socket read honours a deadline.

Socket frames are a 4-byte big-endian length followed by a msgpack map.  The
reader names the largest frame it accepts (``recv_frame(max_bytes=...)``) and
the length prefix is checked against it before a byte of the body is
allocated: the block server sizes its request limit to its pool
(block_server.max_request_bytes), the puller reads replies of MAX_REPLY_BYTES."""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.errors import ConnectionClosedError, FrameTooLargeError, TransferError

MAX_DESCRIPTOR_BYTES = 64 * 1024  # a peer descriptor (NIXL agent metadata is ~0.5 KiB)
MAX_NOTIFICATION_BYTES = 4 * 1024
MAX_REPLY_BYTES = 16 * 1024  # the block server's replies: a status and an error message
_FRAME_HEADER = struct.Struct(">I")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, max_bytes: int, what: str) -> Any:
    """Decodes at most ``max_bytes`` of msgpack; TransferError names ``what`` otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TransferError(f"{what} must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise TransferError(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit; refusing to decode it")
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_str_len=max_bytes, max_bin_len=max_bytes, max_array_len=max_bytes,
            max_map_len=max_bytes, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types
        raise TransferError(f"{what} is not valid msgpack ({type(e).__name__}: {e})") from e


def send_frame(sock: socket.socket, obj: Any, deadline: Deadline) -> None:
    body = pack(obj)
    sock.settimeout(deadline.socket_timeout_s())
    try:
        sock.sendall(_FRAME_HEADER.pack(len(body)) + body)
    except socket.timeout as e:
        raise deadline.timeout_error() from e


def recv_frame(sock: socket.socket, deadline: Deadline, what: str, *, max_bytes: int) -> Any:
    """Reads one frame of at most ``max_bytes``; a longer one raises
    FrameTooLargeError before its body is read (the stream is then unusable)."""
    header = bytearray(_FRAME_HEADER.size)
    recv_exactly(sock, memoryview(header), deadline, what)
    (length,) = _FRAME_HEADER.unpack(header)
    if length > max_bytes:
        raise FrameTooLargeError(f"{what} announces {length} bytes, over the {max_bytes}-byte frame limit")
    body = bytearray(length)
    recv_exactly(sock, memoryview(body), deadline, what)
    return unpack(bytes(body), max_bytes, what)


def recv_exactly(sock: socket.socket, buf: memoryview, deadline: Deadline, what: str) -> None:
    """Fills ``buf`` from ``sock``; raises TransferError on EOF or when the deadline passes."""
    view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    while view.nbytes:
        sock.settimeout(deadline.socket_timeout_s())
        try:
            n = sock.recv_into(view)
        except socket.timeout as e:
            raise deadline.timeout_error() from e
        if n == 0:
            raise ConnectionClosedError(f"connection closed while reading {what} ({view.nbytes} bytes missing)")
        view = view[n:]
