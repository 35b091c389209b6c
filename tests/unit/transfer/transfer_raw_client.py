"""A hand-driven client of the socket fallback's block server, for tests that
speak its protocol directly: one holding the cluster secret, one without it,
or one that breaks the rules (see pdcluster.transfer.block_server for the protocol)."""

from __future__ import annotations

import socket
import time
from typing import Any

from pdcluster.transfer.auth import PULLER_PROOF, ClusterSecret, new_nonce
from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.layout import KVLayout
from pdcluster.transfer.peer import PeerDescriptor
from pdcluster.transfer.wire import MAX_REPLY_BYTES, recv_exactly, recv_frame, send_frame

SECRET = b"unit-test-cluster-secret-0123456789"  # every authenticated test's cluster
OTHER_SECRET = b"another-cluster-secret-9876543210"


def connect(desc: PeerDescriptor, rcvbuf: int | None = None) -> socket.socket:
    host, port = desc.endpoint.rsplit(":", 1)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    return sock


def authenticate(sock: socket.socket, desc: PeerDescriptor, secret: bytes | None, puller_id: str = "decode-9",
                 mac: bytes | None = None) -> Any:
    """Answers the challenge as ``puller_id`` (with ``mac`` if given, else the
    right one for ``secret``); returns the owner's reply."""
    deadline = Deadline(5.0, "raw client authentication")
    challenge = recv_frame(sock, deadline, "challenge", max_bytes=MAX_REPLY_BYTES)
    client_nonce = new_nonce()
    auth: dict[str, Any] = {"op": "auth", "peer_id": puller_id, "nonce": client_nonce}
    if mac is None and secret is not None:
        mac = ClusterSecret(secret).mac(PULLER_PROOF, challenge["nonce"], client_nonce, puller_id, desc.peer_id)
    if mac is not None:
        auth["mac"] = mac
    send_frame(sock, auth, deadline)
    return recv_frame(sock, deadline, "authentication reply", max_bytes=MAX_REPLY_BYTES)


def open_session(desc: PeerDescriptor, secret: bytes | None, layout: KVLayout, puller_id: str = "decode-9",
                 rcvbuf: int | None = None) -> socket.socket:
    """A connection past authentication and hello, ready for requests."""
    sock = connect(desc, rcvbuf)
    assert authenticate(sock, desc, secret, puller_id)["ok"] is True
    deadline = Deadline(5.0, "raw client hello")
    send_frame(sock, {"op": "hello", "epoch": desc.epoch, "layout": layout.to_dict()}, deadline)
    assert recv_frame(sock, deadline, "hello reply", max_bytes=MAX_REPLY_BYTES)["ok"] is True
    return sock


def read_raw_frame(sock: socket.socket) -> bytes:
    """One frame as sent, length prefix included."""
    deadline = Deadline(5.0, "raw client read")
    header = bytearray(4)
    recv_exactly(sock, memoryview(header), deadline, "frame header")
    body = bytearray(int.from_bytes(header, "big"))
    recv_exactly(sock, memoryview(body), deadline, "frame body")
    return bytes(header + body)


def read_until_closed(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    """Every byte the server sends until it closes the connection; fails the
    test if it is still open after ``timeout_s``."""
    received = bytearray()
    end = time.monotonic() + timeout_s
    while True:
        sock.settimeout(max(end - time.monotonic(), 0.001))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(received)
        except socket.timeout:
            raise AssertionError(f"the server kept the connection open for {timeout_s} s") from None
        if not chunk:
            return bytes(received)
        received += chunk
