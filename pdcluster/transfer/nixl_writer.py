"""The owner's half of a pull served as a NIXL WRITE (pull mode "write",
pdcluster.transfer.pull_mode): the owner moves the bytes into the puller's registered
blocks at the puller's authenticated request (messages: pdcluster.transfer.write_request).

    puller                                 owner (this; driven by the backend's ticker)
    ------                                 -----
    send {"op": "write", seq, runs, ttl} -> submit(): queued, stop_at = now + ttl
                                           service(): tag, replay, stop_at, descriptor,
                                             runs, lease (LeaseGuard.begin_read) checked;
                                             a refusal is answered {"ok": false, code}
                                           WRITE posted, its notification {"ok": true}
    wait for seq's "wrote" <------------   sent by NIXL once the bytes landed
                                           service(): DONE/ERR -> LeaseGuard.end_read;
                                             past stop_at or cancelled -> the WRITE
                                             is released (UCX cancels it) and end_read

Unlike a READ, the owner's CPU sees every pull here, so a guarded owner
checks the lease before the first byte and keeps the blocks pinned until the
WRITE is over, as the socket fallback does.  Every begin_read is ended:
on completion, failure, expiry, cancellation and close().

Time is this host's monotonic clock alone: the request carries a time-to-live
(write_request: ``ttl``), and its stop time is fixed when the request is
routed to submit(), not when service() gets to it, so a slow ticker or a busy
queue eats into the ttl instead of extending it.  The puller's clock is never
read here: the hosts' clocks may disagree by any amount."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pdcluster.transfer.errors import TransferError
from pdcluster.transfer.nixl_host import NixlHost
from pdcluster.transfer.layout import layout_differences
from pdcluster.transfer.peer import PeerDescriptor
from pdcluster.transfer.replay_window import ReplayWindow
from pdcluster.transfer.runs import BlockRun, descriptor_array, remote_ids_of, runs_to_regions
from pdcluster.transfer.write_request import WriteCancel, WriteDone, WriteRequest, sign_done, verify


log = logging.getLogger("pdcluster.transfer")

MAX_PULLER_AGENTS = 256  # puller agents kept loaded; the least recently written-to one is dropped beyond it


@dataclass(frozen=True)
class _Received:
    sender: str
    request: WriteRequest
    stop_at: float  # this host's time.monotonic() at receipt + the request's ttl_s


@dataclass
class _Write:
    seq: int
    puller_agent: str
    lease_id: str | None
    guarded: bool  # begin_read allowed it: end_read is owed
    stop_at: float  # as _Received's
    handle: Any


class NixlWriter:
    def __init__(self, backend: NixlHost) -> None:
        self._backend = backend
        self._queue_lock = threading.Lock()
        self._service_lock = threading.Lock()
        self._pending: list[_Received] = []
        self._cancelled: set[tuple[str, int]] = set()
        self._inflight: list[_Write] = []
        self._replays = ReplayWindow()
        self._puller_agents: OrderedDict[str, None] = OrderedDict()
        self.num_written = 0
        self.num_refused = 0

    @property
    def busy(self) -> bool:
        """Writes queued or in flight: the ticker then progresses the worker without pause."""
        return bool(self._pending or self._inflight)

    def submit(self, sender: str, msg: WriteRequest | WriteCancel) -> None:
        """Queues a request, its stop time counted from now, or a cancellation
        (called while routing notifications)."""
        received_at = time.monotonic()
        with self._queue_lock:
            if isinstance(msg, WriteRequest):
                self._pending.append(_Received(sender, msg, received_at + msg.ttl_s))
            elif len(self._cancelled) < 4096:
                self._cancelled.add((sender, msg.seq))

    def service(self) -> None:
        """Starts queued requests and finishes, fails or cancels writes in flight
        (one thread at a time: a second caller returns at once)."""
        if not self._service_lock.acquire(blocking=False):
            return
        try:
            self._service()
        finally:
            self._service_lock.release()

    def _service(self) -> None:
        with self._queue_lock:
            pending, self._pending = self._pending, []
            cancelled, self._cancelled = self._cancelled, set()
        for received in pending:  # a cancellation that came with its request stops it before it starts
            self._start(received, (received.sender, received.request.seq) in cancelled)
        still = []
        for write in self._inflight:
            if not self._progress(write, (write.puller_agent, write.seq) in cancelled):
                still.append(write)
        self._inflight = still

    def close(self) -> None:
        """Releases every write in flight and ends its lease read."""
        with self._service_lock:
            for write in self._inflight:
                self._finish(write, release=True)
            self._inflight = []

    # ---- one request ------------------------------------------------------

    def _start(self, received: _Received, cancelled: bool = False) -> None:
        b = self._backend
        sender, req = received.sender, received.request
        if b._pool is None:
            b._reject_notification("dropping a write request: this side serves no pool: from=%r", sender[:140])
            return
        if not verify(req, b._secret, sender, b.agent_name):
            b._reject_notification("dropping a write request that failed authentication: from=%r", sender[:140])
            return
        if not self._replays.accept(sender, req.seq):
            b._reject_notification("dropping a replayed or stale write request: from=%r seq=%d", sender[:140], req.seq)
            return
        try:
            desc = b._peer_descriptor(req.puller)  # its signature checked with the secret
        except TransferError as e:
            b._reject_notification("dropping a write request with a bad puller descriptor: from=%r error=%s",
                                   sender[:140], e)
            return
        if desc.agent_name != sender or desc.backend != b.name:
            b._reject_notification("dropping a write request whose descriptor names another agent: from=%r",
                                   sender[:140])
            return
        if not self._load_puller(desc):
            return  # its agent cannot be reached: nobody to answer, it times out
        refusal = ("expired", "cancelled by the puller before it started") if cancelled else \
            self._refusal(desc, received)
        if refusal is not None:
            self._reply(sender, WriteDone(req.seq, False, *refusal))
            return
        self._post(desc, req, received.stop_at)

    def _refusal(self, desc: PeerDescriptor, received: _Received) -> tuple[str, str] | None:
        """(code, error) when the request cannot be served, else None."""
        b = self._backend
        assert b._pool is not None and b._layout is not None
        if time.monotonic() >= received.stop_at:
            return "expired", (f"the owner got to the request {received.request.ttl_s:.3f} s or more after "
                               "receiving it: its time-to-live, the puller's wait less a margin, ran out")
        diffs = layout_differences(b._layout, desc.layout)
        if diffs:
            return "refused", f"KV layout mismatch with {b.peer_id}: {', '.join(d[0] for d in diffs)} differ"
        return _runs_error(received.request.runs, b._pool.shape[0], desc.num_blocks, b.peer_id)

    def _post(self, desc: PeerDescriptor, req: WriteRequest, stop_at: float) -> None:
        b = self._backend
        guard = b._lease_guard
        if guard is not None:
            if not req.lease_id:
                self._reply(desc.agent_name, WriteDone(req.seq, False, "lease_required",
                                                       f"{b.peer_id} serves pulls only under a lease: pass the "
                                                       "hand-off's lease id as pull(..., notif=lease_id)"))
                return
            block_ids = list(remote_ids_of(req.runs))
            reason = guard.begin_read(req.lease_id, block_ids)
            if reason is not None:
                log.info("kv nixl owner refused a write: lease=%s blocks=%d reason=%s", req.lease_id,
                         len(block_ids), reason)
                self._reply(desc.agent_name, WriteDone(req.seq, False, "lease_expired",
                                                       f"lease {req.lease_id!r} on {b.peer_id}: {reason}"))
                return
        write = _Write(req.seq, desc.agent_name, req.lease_id, guard is not None, stop_at, None)
        try:
            write.handle = self._initialize(desc, req)
        except Exception as e:  # nixl's errors: the puller's agent went away, bad regions
            self._finish(write, release=False)
            self._reply(desc.agent_name, WriteDone(req.seq, False, "failed", f"NIXL WRITE not posted: {e}"))
            return
        self._inflight.append(write)

    def _initialize(self, desc: PeerDescriptor, req: WriteRequest) -> Any:

        b = self._backend
        assert b._pool is not None
        bb = desc.block_bytes
        own = descriptor_array(runs_to_regions(req.runs, b._pool.data_ptr(), bb, "remote"), b._device_id)
        theirs = descriptor_array(runs_to_regions(req.runs, desc.pool_addr, bb, "local"), desc.device_id)
        done = sign_done(WriteDone(req.seq, True), b._secret, b.agent_name, desc.agent_name).encode()
        with b._lock:
            own_descs = b._agent.get_xfer_descs(own, b._mem_type)
            their_descs = b._agent.get_xfer_descs(theirs, desc.mem_type)
            handle = b._agent.initialize_xfer("WRITE", own_descs, their_descs, desc.agent_name, done)
            try:
                state = b._agent.transfer(handle)
            except Exception:
                b._agent.release_xfer_handle(handle)
                raise
        if state not in ("PROC", "DONE"):
            with b._lock:
                b._agent.release_xfer_handle(handle)
            raise TransferError(f"transfer() returned {state}")
        return handle

    def _progress(self, write: _Write, cancelled: bool) -> bool:
        """True once ``write`` is over (done, failed, expired or cancelled)."""
        b = self._backend
        try:
            with b._lock:
                state = b._agent.check_xfer_state(write.handle)
        except Exception as e:  # nixlRemoteDisconnectError and kin
            state = f"ERR ({type(e).__name__}: {e})"
        if state == "DONE":
            self.num_written += 1
            self._finish(write, release=True)
            return True
        if state == "PROC" and not cancelled and time.monotonic() < write.stop_at:
            return False
        why = "cancelled by the puller" if cancelled else "expired" if state == "PROC" else f"failed: NIXL {state}"
        log.warning("kv nixl owner abandoned a write: puller=%s seq=%d lease=%s reason=%s",
                    write.puller_agent[:140], write.seq, write.lease_id, why)
        self._finish(write, release=True)
        self._reply(write.puller_agent, WriteDone(write.seq, False, "expired" if state == "PROC" else "failed", why))
        return True

    def _finish(self, write: _Write, release: bool) -> None:
        b = self._backend
        if release and write.handle is not None:
            b._release(write.handle, f"write seq {write.seq} to {write.puller_agent[:140]}")
        if write.guarded and b._lease_guard is not None and write.lease_id:
            b._lease_guard.end_read(write.lease_id)

    # ---- the puller's agent -----------------------------------------------

    def _load_puller(self, desc: PeerDescriptor) -> bool:
        b = self._backend
        try:
            b._ensure_remote_agent(desc)
        except TransferError as e:
            log.warning("kv nixl owner cannot reach a puller: agent=%s error=%s", desc.agent_name[:140], e)
            return False
        self._puller_agents[desc.agent_name] = None
        self._puller_agents.move_to_end(desc.agent_name)
        busy = {w.puller_agent for w in self._inflight}
        for name in list(self._puller_agents)[:max(0, len(self._puller_agents) - MAX_PULLER_AGENTS)]:
            if name not in busy and name != desc.agent_name:
                del self._puller_agents[name]
                b._disconnect(name)
        return True

    def _reply(self, puller_agent: str, done: WriteDone) -> None:
        b = self._backend
        if not done.ok:
            self.num_refused += 1
        payload = sign_done(done, b._secret, b.agent_name, puller_agent).encode()
        with b._lock:
            try:
                b._agent.send_notif(puller_agent, payload)
            except Exception as e:  # the puller is gone: it times out on its own
                log.info("kv nixl owner could not answer a puller: agent=%s error=%s", puller_agent[:140], e)


def _runs_error(runs: tuple[BlockRun, ...], owner_blocks: int, puller_blocks: int,
                owner_id: str) -> tuple[str, str] | None:
    if len(runs) > owner_blocks:
        return "refused", f"the request names {len(runs)} runs, more than {owner_id}'s {owner_blocks} blocks"
    for r in runs:
        if r.remote_start + r.num_blocks > owner_blocks or r.local_start + r.num_blocks > puller_blocks:
            return "refused", (f"run {r.remote_start}->{r.local_start} x{r.num_blocks} is outside {owner_id}'s "
                               f"{owner_blocks} blocks or the puller's {puller_blocks}")
    return None
