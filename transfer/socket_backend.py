"""The portable fallback: pulls over a TCP socket to the owner's BlockServer.
Needs only the standard library and torch, works wherever a socket does.

Bytes go from the owner's pool straight into the puller's pool through the
kernel (sendall of a pool view, recv_into a pool view), so a pull costs two
kernel copies and no Python-level copy.  Each puller thread uses its own
connection; idle connections are kept per peer and dropped with the peer."""

from __future__ import annotations

import socket
import threading
from collections import deque
from typing import Any

import torch

from transfer.base import TransferBackend
from transfer.block_server import BlockServer
from transfer.deadline import Deadline
from transfer.errors import LayoutMismatchError, TransferError
from transfer.layout import KVLayout
from transfer.lease_guard import LeaseGuard, lease_expired_error
from transfer.peer import PeerDescriptor
from transfer.pool_bytes import PoolBytes
from transfer.registry import register_backend
from transfer.runs import BlockRun
from transfer.wire import recv_exactly, recv_frame, send_frame


class _SocketPeer:
    """Connections to one peer's BlockServer (one per concurrent pull)."""

    def __init__(self, desc: PeerDescriptor, hello: dict) -> None:
        host, _, port = desc.endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(f"peer {desc.peer_id} has no usable endpoint ({desc.endpoint!r})")
        self.address = (host, int(port))
        self.peer_id = desc.peer_id
        self._hello = hello
        self._idle: deque[socket.socket] = deque()
        self._lock = threading.Lock()

    def checkout(self, deadline: Deadline) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = socket.create_connection(self.address, timeout=deadline.socket_timeout_s())
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            send_frame(sock, self._hello, deadline)
            reply = recv_frame(sock, deadline, f"hello reply from {self.peer_id}")
        except BaseException:
            sock.close()
            raise
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            sock.close()
            error = reply.get("error") if isinstance(reply, dict) else reply
            kind = LayoutMismatchError if "layout mismatch" in str(error) else TransferError
            raise kind(f"peer {self.peer_id} refused the handshake: {error}")
        return sock

    def checkin(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = list(self._idle), deque()
        for sock in idle:
            sock.close()


@register_backend
class SocketBackend(TransferBackend):
    name = "fallback"
    one_sided = False  # the owner's server thread sends every byte
    device_memory = False  # accelerator pools are staged through host memory
    needs_listener = True
    checks_lease_on_read = True  # the owner's server thread asks the LeaseGuard before each read

    def __init__(self, peer_id: str | None = None, timeout_s: float = 10.0, host: str = "127.0.0.1",
                 port: int = 0, max_stage_bytes: int = 64 << 20) -> None:
        super().__init__(peer_id, timeout_s)
        self._host, self._port = host, port
        self._max_stage_bytes = max_stage_bytes
        self._bytes: PoolBytes | None = None
        self._server: BlockServer | None = None
        self._notifications: deque[tuple[str, bytes]] = deque()

    def _register(self, kv_pool: torch.Tensor, layout: KVLayout, lease_guard: LeaseGuard | None) -> None:
        self._bytes = PoolBytes(kv_pool, layout.block_bytes, self._max_stage_bytes)
        self._server = BlockServer(self._bytes, layout, self.peer_id, self.epoch,
                                   lambda sender, payload: self._notifications.append((sender, payload)),
                                   host=self._host, port=self._port, lease_guard=lease_guard)

    def _describe_fields(self) -> dict:
        assert self._server is not None and self._bytes is not None
        pool = self._bytes.kv_pool
        return {"endpoint": self._server.endpoint, "mem_type": "DRAM" if self._bytes.on_host else "VRAM",
                "device_id": pool.device.index or 0}

    def _connect(self, desc: PeerDescriptor, deadline: Deadline) -> _SocketPeer:
        assert self._layout is not None
        hello = {"op": "hello", "peer_id": self.peer_id, "epoch": desc.epoch, "layout": self._layout.to_dict()}
        peer = _SocketPeer(desc, hello)
        peer.checkin(peer.checkout(deadline))  # handshake now: refusals surface at the first pull
        return peer

    def _disconnect(self, conn: _SocketPeer) -> None:
        conn.close()

    def _read_runs(self, conn: _SocketPeer, desc: PeerDescriptor, runs: list[BlockRun],
                   lease_id: str | None, deadline: Deadline) -> None:
        assert self._bytes is not None
        sock = conn.checkout(deadline)
        request: dict[str, Any] = {"op": "read", "runs": [[r.remote_start, r.num_blocks] for r in runs]}
        if lease_id is not None:
            request["lease"] = lease_id
        try:
            send_frame(sock, request, deadline)
            reply = recv_frame(sock, deadline, f"read reply from {desc.peer_id}")
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


def _refusal_error(desc: PeerDescriptor, lease_id: str | None, reply: Any) -> TransferError:
    if isinstance(reply, dict) and reply.get("code") == "lease_expired":
        return lease_expired_error(lease_id, desc.peer_id, f"the owner refused the read: {reply.get('error')}")
    return TransferError(f"peer {desc.peer_id} refused the read: {reply!r:.300}")
