"""The portable fallback: pulls over a TCP socket to the owner's BlockServer.
Needs only the standard library and torch, works wherever a socket does.

Bytes go from the owner's pool straight into the puller's pool through the
kernel (sendall of a pool view, recv_into a pool view), so a pull costs two
kernel copies and no Python-level copy.  Each puller thread uses its own
connection; idle connections are kept per peer and dropped with the peer, or
once idle for half the owner's idle timeout (the owner closes them then).
With a cluster secret both ends of every connection prove they hold it
(pdcluster.transfer.socket_auth) before the hello (pdcluster.transfer.block_server has the
protocol and the owner's limits)."""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from typing import Any

import torch

from pdcluster.transfer.auth import ClusterSecret
from pdcluster.transfer.base import TransferBackend
from pdcluster.transfer.block_server import BlockServer, ServerLimits
from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.errors import LayoutMismatchError, TransferError
from pdcluster.transfer.layout import KVLayout
from pdcluster.transfer.lease_guard import LeaseGuard, lease_expired_error
from pdcluster.transfer.peer import PeerDescriptor
from pdcluster.transfer.pool_bytes import PoolBytes
from pdcluster.transfer.runs import BlockRun
from pdcluster.transfer.socket_auth import answer_challenge
from pdcluster.transfer.wire import MAX_REPLY_BYTES, recv_exactly, recv_frame, send_frame


class _SocketPeer:
    """Connections to one peer's BlockServer (one per concurrent pull), each
    authenticated and greeted once when opened (see pdcluster.transfer.block_server)."""

    def __init__(self, desc: PeerDescriptor, puller_id: str, secret: ClusterSecret | None, hello: dict) -> None:
        host, _, port = desc.endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(f"peer {desc.peer_id} has no usable endpoint ({desc.endpoint!r})")
        self.address = (host, int(port))
        self.peer_id = desc.peer_id
        self._puller_id = puller_id
        self._secret = secret
        self._hello = hello
        self._max_idle_s = float("inf")  # half the owner's idle timeout, once its hello reply told it
        self._idle: deque[tuple[socket.socket, float]] = deque()  # (socket, monotonic time of checkin)
        self._lock = threading.Lock()

    def checkout(self, deadline: Deadline) -> socket.socket:
        """An idle connection the owner has not closed, else a new one."""
        with self._lock:
            while self._idle:
                sock, since = self._idle.pop()
                if time.monotonic() - since < self._max_idle_s and _still_open(sock):
                    return sock
                sock.close()
        return self._open(deadline)

    def checkin(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append((sock, time.monotonic()))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = list(self._idle), deque()
        for sock, _ in idle:
            sock.close()

    def _open(self, deadline: Deadline) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=deadline.socket_timeout_s())
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            answer_challenge(sock, deadline, self._secret, self._puller_id, self.peer_id,
                             f"{self.address[0]}:{self.address[1]}")
            send_frame(sock, self._hello, deadline)
            reply = recv_frame(sock, deadline, f"hello reply from {self.peer_id}", max_bytes=MAX_REPLY_BYTES)
        except BaseException:
            sock.close()
            raise
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            sock.close()
            error = reply.get("error") if isinstance(reply, dict) else reply
            kind = LayoutMismatchError if "layout mismatch" in str(error) else TransferError
            raise kind(f"peer {self.peer_id} refused the handshake: {error}")
        idle_s = reply.get("idle_timeout_s")
        if isinstance(idle_s, (int, float)) and idle_s > 0:
            self._max_idle_s = idle_s / 2  # retire a connection well before the owner would close it
        return sock


class SocketBackend(TransferBackend):
    name = "fallback"
    one_sided = False  # the owner's server thread sends every byte
    device_memory = False  # accelerator pools are staged through host memory
    needs_listener = True
    checks_lease_on_read = True  # the owner's server thread asks the LeaseGuard before each read

    def __init__(self, peer_id: str | None = None, timeout_s: float = 10.0, secret: bytes | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_stage_bytes: int = 64 << 20,
                 limits: ServerLimits = ServerLimits()) -> None:
        """``limits`` bound the owner's block server (connections, idle and handshake timeouts)."""
        super().__init__(peer_id, timeout_s, secret)
        self._host, self._port = host, port
        self._limits = limits
        self._max_stage_bytes = max_stage_bytes
        self._bytes: PoolBytes | None = None
        self._server: BlockServer | None = None
        self._notifications: deque[tuple[str, bytes]] = deque()

    def _register(self, kv_pool: torch.Tensor, layout: KVLayout, lease_guard: LeaseGuard | None) -> None:
        self._bytes = PoolBytes(kv_pool, layout.block_bytes, self._max_stage_bytes)
        self._server = BlockServer(self._bytes, layout, self.peer_id, self.epoch,
                                   self._received,
                                   host=self._host, port=self._port, lease_guard=lease_guard,
                                   secret=self._secret, limits=self._limits)

    def _received(self, sender: str, payload: bytes) -> None:
        self._notifications.append((sender, payload))
        self._arrived.set()

    @property
    def server(self) -> BlockServer | None:
        """The owner's block server once a pool is registered (its counters: num_connections, ...)."""
        return self._server

    def _describe_fields(self) -> dict:
        assert self._server is not None and self._bytes is not None
        pool = self._bytes.kv_pool
        return {"endpoint": self._server.endpoint, "mem_type": "DRAM" if self._bytes.on_host else "VRAM",
                "device_id": pool.device.index or 0}

    def _connect(self, desc: PeerDescriptor, deadline: Deadline) -> _SocketPeer:
        assert self._layout is not None
        hello = {"op": "hello", "epoch": desc.epoch, "layout": self._layout.to_dict()}
        peer = _SocketPeer(desc, self.peer_id, self._secret, hello)
        peer.checkin(peer.checkout(deadline))  # handshake now: refusals surface at the first pull
        return peer

    def _disconnect(self, conn: _SocketPeer) -> None:
        conn.close()

    def _read_runs(self, conn: _SocketPeer, desc: PeerDescriptor, runs: list[BlockRun],
                   lease_id: str | None, deadline: Deadline) -> None:
        # The owner's frame limit fits a read of one run per block of its pool:
        # only a pull naming remote blocks twice needs more than one read.
        for first in range(0, len(runs), desc.num_blocks):
            self._read(conn, desc, runs[first:first + desc.num_blocks], lease_id, deadline)

    def _read(self, conn: _SocketPeer, desc: PeerDescriptor, runs: list[BlockRun],
              lease_id: str | None, deadline: Deadline) -> None:
        sock = conn.checkout(deadline)
        request: dict[str, Any] = {"op": "read", "runs": [[r.remote_start, r.num_blocks] for r in runs]}
        if lease_id is not None:
            request["lease"] = lease_id
        try:
            send_frame(sock, request, deadline)
            reply = recv_frame(sock, deadline, f"read reply from {desc.peer_id}", max_bytes=MAX_REPLY_BYTES)
            expected = sum(r.num_blocks for r in runs) * desc.block_bytes
            refused = not isinstance(reply, dict) or reply.get("ok") is not True
            if not refused and reply.get("num_bytes") != expected:
                raise TransferError(f"peer {desc.peer_id} announced {reply.get('num_bytes')!r} bytes "
                                    f"for a read of {expected}; both sides must run the same pdcluster")
            if not refused:
                self._receive(sock, desc, runs, deadline)
        except BaseException:
            sock.close()  # mid-stream: the connection cannot be reused
            raise
        conn.checkin(sock)  # a refusal is a whole reply: the connection stays usable
        if refused:
            raise _refusal_error(desc, lease_id, reply)

    def _receive(self, sock: socket.socket, desc: PeerDescriptor, runs: list[BlockRun], deadline: Deadline) -> None:
        assert self._bytes is not None
        for chunk in self._bytes.chunks(runs):
            buf = self._bytes.write_buffer(chunk.local_start, chunk.num_blocks)
            recv_exactly(sock, buf, deadline, f"blocks from {desc.peer_id}")
            self._bytes.commit(chunk.local_start, chunk.num_blocks, buf)

    def _notify(self, conn: _SocketPeer, desc: PeerDescriptor, notif_payload: bytes, deadline: Deadline) -> None:
        sock = conn.checkout(deadline)
        try:
            send_frame(sock, {"op": "notify", "payload": notif_payload}, deadline)
        except BaseException:
            sock.close()
            raise
        conn.checkin(sock)

    def _raw_notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._notifications:
            out.append(self._notifications.popleft())
        return out

    def _close(self) -> None:
        if self._server is not None:
            self._server.close()


def _still_open(sock: socket.socket) -> bool:
    """False once the owner closed (or reset) an idle connection; never blocks."""
    sock.settimeout(0.0)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True  # nothing to read: still open
    except OSError:
        return False
    return False  # end of stream, or bytes nobody asked for: not reusable either way


def _refusal_error(desc: PeerDescriptor, lease_id: str | None, reply: Any) -> TransferError:
    if isinstance(reply, dict) and reply.get("code") == "lease_expired":
        return lease_expired_error(lease_id, desc.peer_id, f"the owner refused the read: {reply.get('error')}")
    return TransferError(f"peer {desc.peer_id} refused the read: {reply!r:.300}")
