"""Owner side of the socket fallback: a TCP server (127.0.0.1 by default)
whose per-connection threads stream block bytes to pullers.

Protocol, one connection per puller thread, frames as in pdcluster.transfer.wire:

    (the mutual challenge of pdcluster.transfer.socket_auth)           -> a refused puller is closed
    puller -> {"op": "hello", "epoch", "layout"}             -> {"ok": true, "idle_timeout_s"}
                                                                | {"ok": false, "error"}
    puller -> {"op": "read", "runs": [[start, n], ...],      -> {"ok": true, "num_bytes": N} + N raw bytes
               "lease": lease_id (optional)}                    | {"ok": false, "error", "code"?}
    puller -> {"op": "notify", "payload": bytes}             (no reply)

Nothing that tells of the pool (epoch, layout, size, bytes, leases) is said
or done before the puller proved it holds the cluster secret.

Limits (ServerLimits): at most ``max_connections`` connections (and threads)
at once, the next ones are closed unread; ``handshake_timeout_s`` for the
challenge .. hello; ``idle_timeout_s`` between requests; every frame checked
from its length prefix against what the pool can need (max_request_bytes).

The raw bytes of a read are the runs' blocks back to back, in request order.
With a LeaseGuard, a read names the lease its blocks were lent under and is
served only if the guard allows it (code "lease_expired" otherwise, and
"lease_required" for a read naming no lease); the guard keeps the blocks
pinned from before the reply until the last byte was handed to the kernel,
or the stream failed (begin_read .. end_read).  A refusal leaves the
connection usable."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdcluster.transfer.auth import ClusterSecret
from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.errors import ConnectionClosedError, TransferError
from pdcluster.transfer.layout import KVLayout
from pdcluster.transfer.lease_guard import LeaseGuard
from pdcluster.transfer.peer import MAX_LEASE_ID_CHARS
from pdcluster.transfer.pool_bytes import PoolBytes
from pdcluster.transfer.runs import BlockRun
from pdcluster.transfer.socket_auth import HANDSHAKE_FRAME_BYTES, PullerRefused, challenge_puller
from pdcluster.transfer.wire import MAX_NOTIFICATION_BYTES, recv_frame, send_frame

log = logging.getLogger("pdcluster.transfer")

MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 30.0
HANDSHAKE_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 30.0
FAILED_AUTH_LOG_INTERVAL_S = 10.0  # a stranger retrying cannot flood the log
_REQUEST_OVERHEAD_BYTES = 1024 + 4 * MAX_LEASE_ID_CHARS  # op, keys, headers; a lease id of 4-byte chars


@dataclass(frozen=True)
class ServerLimits:
    max_connections: int = MAX_CONNECTIONS  # beyond it a new connection is closed, no thread started
    idle_timeout_s: float = IDLE_TIMEOUT_S  # between requests of an authenticated puller
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S  # from accept to the hello's reply
    send_timeout_s: float = SEND_TIMEOUT_S  # per reply, and per chunk of block bytes

    def __post_init__(self) -> None:
        if not (isinstance(self.max_connections, int) and self.max_connections > 0):
            raise ValueError(f"max_connections must be a positive int, got {self.max_connections!r}")
        for name in ("idle_timeout_s", "handshake_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


def max_request_bytes(num_blocks: int) -> int:
    """The largest request a pool of ``num_blocks`` blocks can need: a read of
    one run per block (the most a read may name) under the longest lease id,
    or a notification."""
    run_bytes = 1 + 2 * _msgpack_uint_bytes(num_blocks)  # [start, n], both <= num_blocks
    return _REQUEST_OVERHEAD_BYTES + max(num_blocks * run_bytes, MAX_NOTIFICATION_BYTES)


def _msgpack_uint_bytes(value: int) -> int:
    for size, bound in ((1, 1 << 7), (2, 1 << 8), (3, 1 << 16), (5, 1 << 32)):
        if value < bound:
            return size
    return 9


class BlockServer:
    def __init__(self, pool_bytes: PoolBytes, layout: KVLayout, peer_id: str, epoch: int,
                 on_notification: Callable[[str, bytes], None], host: str = "127.0.0.1", port: int = 0,
                 lease_guard: LeaseGuard | None = None, secret: ClusterSecret | None = None,
                 limits: ServerLimits = ServerLimits()) -> None:
        self._pool_bytes = pool_bytes
        self._lease_guard = lease_guard
        self._layout = layout
        self._peer_id = peer_id
        self._epoch = epoch
        self._on_notification = on_notification
        self._secret = secret
        self.limits = limits
        self.max_request_bytes = max_request_bytes(pool_bytes.num_blocks)
        self.num_refused_connections = 0  # closed at the cap
        self.num_failed_authentications = 0
        self._failed_auth_logged_at = -FAILED_AUTH_LOG_INTERVAL_S
        self._at_cap = False
        self._listener = socket.create_server((host, port), backlog=128)
        self.endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"kv-block-server-{peer_id}",
                                               daemon=True)
        self._accept_thread.start()

    @property
    def num_connections(self) -> int:
        """Open connections, one serving thread each (never above limits.max_connections)."""
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        self._stopped.set()
        _shutdown(self._listener)
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            _shutdown(conn)
        self._accept_thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener shut down by close()
            with self._lock:
                if self._stopped.is_set():
                    _shutdown(conn)
                    return
                admitted = len(self._conns) < self.limits.max_connections
                if admitted:
                    self._conns.add(conn)
                else:
                    self.num_refused_connections += 1
                    first_refusal, self._at_cap = not self._at_cap, True
            if not admitted:
                _shutdown(conn)  # unread, nothing said, no thread
                if first_refusal:
                    log.warning("kv block server at its connection cap, closing new connections: peer=%s max=%d",
                                self._peer_id, self.limits.max_connections)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name=f"kv-block-conn-{self._peer_id}",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        puller = None
        try:
            handshake = Deadline(self.limits.handshake_timeout_s, "handshake with a puller")
            puller = challenge_puller(conn, handshake, self._secret, self._peer_id,
                                      on_refused=lambda claimed: self._count_failed_authentication(conn, claimed))
            self._hello(conn, handshake, puller)
            while not self._stopped.is_set():
                request = self._next_request(conn, puller)
                if request is None:
                    return
                op = request.get("op") if isinstance(request, dict) else None
                if op == "read":
                    self._send_runs(conn, request.get("runs"), request.get("lease"))
                elif op == "notify" and isinstance(request.get("payload"), bytes) \
                        and len(request["payload"]) <= MAX_NOTIFICATION_BYTES:
                    self._on_notification(puller, request["payload"])
                else:
                    self._reply(conn, {"ok": False, "error": f"unknown request {str(request)[:100]}"})
                    return
        except ConnectionClosedError:
            pass  # the puller went away between requests: the normal end of a connection
        except PullerRefused:
            pass  # counted and logged by on_refused before the refusal went out
        except (TransferError, OSError) as e:
            if not self._stopped.is_set():  # a stranger's broken handshake is not worth an operator's time
                log.log(logging.INFO if puller else logging.DEBUG,
                        "kv block server dropped a connection: puller=%s reason=%s", puller or "unauthenticated", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                if self._at_cap and len(self._conns) < self.limits.max_connections:
                    self._at_cap = False
                    log.info("kv block server below its connection cap again: peer=%s refused_total=%d",
                             self._peer_id, self.num_refused_connections)
            _shutdown(conn)

    def _next_request(self, conn: socket.socket, puller: str) -> Any:
        """The next request, or None once the puller stayed idle past idle_timeout_s."""
        idle = Deadline(self.limits.idle_timeout_s, f"next request from {puller}")
        try:
            return recv_frame(conn, idle, f"request from {puller}", max_bytes=self.max_request_bytes)
        except TransferError:
            if not idle.expired():
                raise
        log.debug("kv block server closed an idle connection: puller=%s idle_s=%g", puller, idle.timeout_s)
        return None

    def _count_failed_authentication(self, conn: socket.socket, claimed: str | None) -> None:
        """Counts every failure; logs the first, then at most one line per FAILED_AUTH_LOG_INTERVAL_S."""
        now = time.monotonic()
        with self._lock:
            self.num_failed_authentications += 1
            failed = self.num_failed_authentications
            quiet = now - self._failed_auth_logged_at < FAILED_AUTH_LOG_INTERVAL_S
            if not quiet:
                self._failed_auth_logged_at = now
        if not quiet:
            log.warning("kv block server refused a puller that failed authentication (wrong or no cluster "
                        "secret): peer=%s from=%s claimed=%r failed_total=%d", self._peer_id, _address(conn),
                        claimed or "?", failed)

    def _hello(self, conn: socket.socket, deadline: Deadline, puller: str) -> None:
        hello = recv_frame(conn, deadline, f"hello from {puller}", max_bytes=HANDSHAKE_FRAME_BYTES)
        if not isinstance(hello, dict) or hello.get("op") != "hello":
            raise TransferError("first frame after authentication was not a hello")
        error = self._hello_error(hello, puller)
        if error is None:
            send_frame(conn, {"ok": True, "idle_timeout_s": self.limits.idle_timeout_s}, deadline)
            return
        send_frame(conn, {"ok": False, "error": error}, deadline)
        raise TransferError(error)

    def _hello_error(self, hello: dict[str, Any], puller: str) -> str | None:
        if hello.get("epoch") != self._epoch:
            return (f"stale descriptor: {self._peer_id} restarted (epoch {self._epoch:x} now, "
                    f"{hello.get('epoch')!r} asked); fetch its current descriptor")
        try:
            theirs = KVLayout.from_dict(hello.get("layout"))
        except (TypeError, ValueError) as e:
            return f"hello carries no valid layout: {e}"
        if theirs != self._layout:
            return f"KV layout mismatch: {self._peer_id} holds {self._layout}, {puller} has {theirs}"
        return None

    def _send_runs(self, conn: socket.socket, raw_runs: Any, lease_id: Any) -> None:
        runs = self._parse_runs(raw_runs)
        if isinstance(runs, str):
            self._reply(conn, {"ok": False, "error": runs})
            return
        refusal = self._begin_read(lease_id, runs)
        if refusal is not None:
            self._reply(conn, refusal)
            return
        try:
            total = sum(r.num_blocks for r in runs) * self._pool_bytes.block_bytes
            self._reply(conn, {"ok": True, "num_bytes": total})
            conn.settimeout(self.limits.send_timeout_s)
            for chunk in self._pool_bytes.chunks(runs):
                conn.sendall(self._pool_bytes.read(chunk.remote_start, chunk.num_blocks))
        finally:
            if self._lease_guard is not None:
                self._lease_guard.end_read(lease_id)

    def _begin_read(self, lease_id: Any, runs: list[BlockRun]) -> dict[str, Any] | None:
        """None when the read may go ahead (the guard now pins its blocks), else the refusal to send."""
        if self._lease_guard is None:
            return None
        if not isinstance(lease_id, str) or not lease_id:
            return {"ok": False, "code": "lease_required",
                    "error": f"{self._peer_id} serves reads only under a lease: pass the hand-off's lease id "
                             "as pull(..., notif=lease_id)"}
        block_ids = [b for r in runs for b in range(r.remote_start, r.remote_start + r.num_blocks)]
        reason = self._lease_guard.begin_read(lease_id, block_ids)
        if reason is None:
            return None
        log.info("kv block server refused a read: lease=%s blocks=%d reason=%s", lease_id, len(block_ids), reason)
        return {"ok": False, "code": "lease_expired", "error": f"lease {lease_id!r} on {self._peer_id}: {reason}"}

    def _parse_runs(self, raw_runs: Any) -> list[BlockRun] | str:
        """The runs, or an error message for the puller."""
        num_blocks = self._pool_bytes.num_blocks
        if not isinstance(raw_runs, list) or not raw_runs:
            return "read needs a non-empty list of [start, num_blocks] runs"
        if len(raw_runs) > num_blocks:
            return f"read names {len(raw_runs)} runs, more than the {num_blocks} blocks of {self._peer_id}'s pool"
        runs = []
        for item in raw_runs:
            if (not isinstance(item, list) or len(item) != 2 or not all(type(x) is int for x in item)
                    or item[0] < 0 or item[1] <= 0 or item[0] + item[1] > num_blocks):
                return f"run {item!r:.50} is outside {self._peer_id}'s pool of {num_blocks} blocks"
            runs.append(BlockRun(item[0], 0, item[1]))
        return runs

    def _reply(self, conn: socket.socket, obj: dict[str, Any]) -> None:
        send_frame(conn, obj, Deadline(self.limits.send_timeout_s, "reply to a puller"))


def _address(conn: socket.socket) -> str:
    try:
        host, port, *_ = conn.getpeername()
        return f"{host}:{port}"
    except OSError:
        return "?"


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
