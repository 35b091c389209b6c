"""Owner side of the socket fallback: a TCP server (127.0.0.1 by default)
whose per-connection threads stream block bytes to pullers.

Protocol, one connection per puller thread, frames as in transfer.wire:

    puller -> {"op": "hello", "peer_id", "epoch", "layout"}  -> {"ok": true} | {"ok": false, "error"}
    puller -> {"op": "read", "runs": [[start, n], ...],     -> {"ok": true, "num_bytes": N} + N raw bytes
               "lease": lease_id (optional)}                  | {"ok": false, "error", "code"?}
    puller -> {"op": "notify", "payload": bytes}             (no reply)

The raw bytes are the runs' blocks back to back, in request order.

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
from collections.abc import Callable
from typing import Any

from transfer.deadline import Deadline
from transfer.errors import ConnectionClosedError, TransferError
from transfer.layout import KVLayout
from transfer.lease_guard import LeaseGuard
from transfer.pool_bytes import PoolBytes
from transfer.runs import BlockRun
from transfer.wire import MAX_NOTIFICATION_BYTES, recv_frame, send_frame

log = logging.getLogger("pdcluster.transfer")


class BlockServer:
    def __init__(self, pool_bytes: PoolBytes, layout: KVLayout, peer_id: str, epoch: int,
                 on_notification: Callable[[str, bytes], None], host: str = "127.0.0.1", port: int = 0,
                 send_timeout_s: float = 30.0, lease_guard: LeaseGuard | None = None) -> None:
        self._pool_bytes = pool_bytes
        self._lease_guard = lease_guard
        self._layout = layout
        self._peer_id = peer_id
        self._epoch = epoch
        self._on_notification = on_notification
        self._send_timeout_s = send_timeout_s
        self._listener = socket.create_server((host, port))
        self.endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"kv-block-server-{peer_id}",
                                               daemon=True)
        self._accept_thread.start()

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
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._stopped.is_set():
                    _shutdown(conn)
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"kv-block-conn-{self._peer_id}",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        puller = "unknown"
        try:
            puller = self._hello(conn)
            while not self._stopped.is_set():
                request = recv_frame(conn, None, f"request from {puller}")
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
        except (TransferError, OSError) as e:
            if not self._stopped.is_set():
                log.info("kv block server dropped a connection: puller=%s reason=%s", puller, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            _shutdown(conn)

    def _hello(self, conn: socket.socket) -> str:
        hello = recv_frame(conn, Deadline(self._send_timeout_s, "hello from a puller"), "hello")
        if not isinstance(hello, dict) or hello.get("op") != "hello" or not isinstance(hello.get("peer_id"), str):
            raise TransferError("first frame was not a hello")
        error = self._hello_error(hello)
        self._reply(conn, {"ok": error is None, "error": error})
        if error is not None:
            raise TransferError(error)
        return hello["peer_id"]

    def _hello_error(self, hello: dict[str, Any]) -> str | None:
        if hello.get("epoch") != self._epoch:
            return (f"stale descriptor: {self._peer_id} restarted (epoch {self._epoch:x} now, "
                    f"{hello.get('epoch')!r} asked); fetch its current descriptor")
        try:
            theirs = KVLayout.from_dict(hello.get("layout"))
        except (TypeError, ValueError) as e:
            return f"hello carries no valid layout: {e}"
        if theirs != self._layout:
            return f"KV layout mismatch: {self._peer_id} holds {self._layout}, {hello['peer_id']} has {theirs}"
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
            conn.settimeout(self._send_timeout_s)
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
        if not isinstance(raw_runs, list) or not raw_runs:
            return "read needs a non-empty list of [start, num_blocks] runs"
        runs = []
        for item in raw_runs:
            if (not isinstance(item, list) or len(item) != 2 or not all(type(x) is int for x in item)
                    or item[0] < 0 or item[1] <= 0 or item[0] + item[1] > self._pool_bytes.num_blocks):
                return f"run {item!r:.50} is outside {self._peer_id}'s pool of {self._pool_bytes.num_blocks} blocks"
            runs.append(BlockRun(item[0], 0, item[1]))
        return runs

    def _reply(self, conn: socket.socket, obj: dict[str, Any]) -> None:
        send_frame(conn, obj, Deadline(self._send_timeout_s, "reply to a puller"))


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
