"""The transfer seam: one ABC every backend implements.

    owner (prefill)                            puller (decode)
    ---------------                            ---------------
    register_pool(kv_pool, layout,             register_pool(kv_pool, layout)
                  lease_guard=leases)
    describe() -> bytes  ---- out of band ---> pull(descriptor, remote_ids, local_ids,
    (+ lease_id, lease_deadline_unix)               notif=lease_id,
                                                    lease_deadline_unix=...) -> TransferStats
    poll_notifications() <--- lease_id ------  (sent once the bytes have landed in time)
    (or wait_notifications)
      -> LeaseTable.release(lease_id)          release(descriptor, lease_id): "I will not pull"

How the lease keeps a read from seeing recycled blocks (pdcluster.transfer.lease_guard):

    socket fallback   the owner serves every read: it asks the LeaseGuard before
                      the first byte (live lease, every block in it) and keeps the
                      blocks pinned until the last byte left (begin_read..end_read);
                      a refused read raises LeaseExpiredError on the puller.
    NIXL              reads are one-sided: the owner's CPU never sees them, so the
                      guard is not consulted.  The puller starts no read later than
                      deadline - LEASE_SAFETY_MARGIN_S, bounds it by the lease, and
                      discards bytes that landed after the deadline; the owner
                      frees the blocks only OWNER_FREE_GRACE_S after the deadline.
    NIXL, pull mode   (over TCP, pdcluster.transfer.pull_mode) the owner WRITEs at the
    "write"           puller's signed request: it asks the guard first and keeps
                      the blocks pinned until the WRITE is over, as the socket
                      fallback does (pdcluster.transfer.nixl_writer); the puller's checks
                      run as well.
    both              the puller's checks run on every backend; a pull that
                      fails them sends no notification (see pull).

What the cluster secret protects (``secret=``, >= 16 random bytes, the same on
every replica; the serving layer always passes one: only unit tests, the
bench and single-process use run without, and then nothing below holds and
anyone who reaches the port or agent is served as before):

    socket fallback   every connection to the block server opens with a mutual
                      HMAC challenge (pdcluster.transfer.block_server) before any hello,
                      epoch, layout, block or lease message; a client without
                      the secret gets one fixed refusal and a closed socket.
                      The server caps connections, times out idle and
                      handshaking ones, and bounds every frame by its pool.
                      Bytes are authenticated per connection, not encrypted:
                      whoever can sniff the link (loopback by default) sees KV.
    NIXL (write)      every write request, answer and cancellation carries a tag
                      over both agents' names and its fields; the owner refuses
                      replays (pdcluster.transfer.replay_window) and requests whose
                      time-to-live ran out on its own clock (no clock of the
                      puller is trusted), and writes only into the pool a signed
                      descriptor names.
    NIXL              describe() signs the descriptor and pull() checks the
                      signature before loading its agent metadata, so a forged
                      descriptor cannot point a puller at another agent or
                      address.  READs are one-sided and never see the secret:
                      the pool is only as protected as the UCX endpoint (any
                      process that holds the agent metadata, which is signed,
                      not hidden, can read it; on one host, any process of the
                      same user can read it anyway).  Keep UCX on loopback or a
                      private fabric.
    both              a release notification carries an HMAC tag over (sender,
                      owner, owner epoch, lease id); poll_notifications drops
                      and counts those without a valid one.  Not covered: a
                      captured notification replayed to the same owner before
                      it restarts (it could release a re-lent lease of that id).

The base class owns what every backend shares: validating block ids,
coalescing runs, the per-peer handshake cache (layout check, re-handshake on a
new epoch), deadlines (the transfer's and the lease's), stats and
notifications.  A backend supplies the transport through the ``_``-prefixed
hooks."""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pdcluster.transfer.auth import DESCRIPTOR, LEASE_RELEASE, ClusterSecret
from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.checksum import block_checksums, first_mismatch
from pdcluster.transfer.errors import (AuthenticationError, LeaseExpiredError, TransferCorruptError, TransferError,
                             TransferInDoubtError)
from pdcluster.transfer.layout import KVLayout, check_compatible, check_pool
from pdcluster.transfer.lease_guard import LeaseClock, LeaseGuard
from pdcluster.transfer.peer import (Notification, PeerDescriptor, agent_name, check_lease_id, check_peer_id,
                           decode_notification, encode_notification)
from pdcluster.transfer.runs import BlockRun, as_block_ids, check_block_ids, coalesce_block_runs

log = logging.getLogger("pdcluster.transfer")

PEER_IDLE_S = 600.0
_MAX_CHECKED_DESCRIPTORS = 256  # a few per peer and epoch; more only after many restarts


@dataclass(frozen=True)
class TransferStats:
    backend: str
    peer_id: str
    num_blocks: int
    num_bytes: int
    seconds: float
    num_descriptors: int  # after coalescing runs of consecutive blocks

    @property
    def gbytes_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _CachedPeer:
    epoch: int
    conn: Any  # whatever the backend's _connect returned
    last_used: float = 0.0  # time.monotonic()


class TransferBackend(ABC):
    """Moves whole KV blocks from a peer's pool into this side's pool.

    Capability flags (class attributes, so the serving layer can read them
    before creating anything):

    ``one_sided``       a pull completes without the owner's CPU taking part
                        (RDMA, same-host CMA); a stalled owner does not stall it.
    ``device_memory``   accelerator pools move without staging through host memory.
    ``needs_listener``  the owner opens a TCP port (127.0.0.1 unless configured).
    ``checks_lease_on_read``  the owner consults its LeaseGuard on every read;
                        when False only the puller's deadline checks protect it.

    pull, release, describe and poll_notifications may be called from several threads.
    pull blocks the calling thread (run it in an executor from async code) and
    never takes longer than its timeout plus one transport call."""

    name: ClassVar[str]
    one_sided: ClassVar[bool]
    device_memory: ClassVar[bool]
    needs_listener: ClassVar[bool]
    checks_lease_on_read: ClassVar[bool]

    def __init__(self, peer_id: str | None = None, timeout_s: float = 10.0, secret: bytes | None = None) -> None:
        """``secret``: the cluster's (see the top of this module); with it every
        peer must prove it holds the same one, without it nobody has to."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._secret = ClusterSecret.of(secret)
        self.peer_id = check_peer_id(peer_id or default_peer_id())
        self.epoch = secrets.randbits(63) | 1  # new on every start: pullers re-handshake
        self.timeout_s = timeout_s
        self.num_handshakes = 0
        self.num_rejected_notifications = 0  # dropped: malformed, or (with a secret) a missing or wrong tag
        self.num_corrupt_pulls = 0  # landed, but a block's checksum differed from the owner's hand-off
        self._arrived = threading.Event()  # set by a backend when a notification came in
        self._pool: torch.Tensor | None = None
        self._layout: KVLayout | None = None
        self._peers: dict[str, _CachedPeer] = {}
        self._peer_locks: dict[str, threading.Lock] = {}
        self.peer_idle_s = PEER_IDLE_S  # a peer unused this long is dropped when another one is added
        self._peers_lock = threading.Lock()
        self._checked_descriptors: dict[bytes, PeerDescriptor] = {}  # encoded -> decoded, signature checked
        self._closed = False

    @property
    def agent_name(self) -> str:
        return agent_name(self.peer_id, self.epoch)

    # ---- public API -------------------------------------------------------

    def register_pool(self, kv_pool: torch.Tensor, layout: KVLayout, lease_guard: LeaseGuard | None = None) -> None:
        """Serves ``kv_pool`` to pullers.  With ``lease_guard`` a backend that
        ``checks_lease_on_read`` serves a read only under a live lease covering
        every block read (and refuses reads that name no lease)."""
        if self._pool is not None:
            raise RuntimeError(f"{self.name} backend {self.peer_id} already serves a pool; create one backend per pool")
        check_pool(kv_pool, layout)
        self._register(kv_pool, layout, lease_guard)
        self._pool, self._layout = kv_pool, layout

    @property
    def authenticated(self) -> bool:
        """True when this backend was given the cluster secret (peers must prove it)."""
        return self._secret is not None

    def descriptor(self) -> PeerDescriptor:
        """This side's descriptor, signed when a secret is set."""
        pool, layout = self._require_pool()
        desc = PeerDescriptor(backend=self.name, peer_id=self.peer_id, epoch=self.epoch, layout=layout,
                              num_blocks=pool.shape[0], **self._describe_fields())
        return desc if self._secret is None else desc.signed(self._secret.mac(DESCRIPTOR, desc.body()))

    def describe(self) -> bytes:
        """The msgpack descriptor a puller needs; hand it over out of band once."""
        return self.descriptor().encode()

    def pull(self, peer: PeerDescriptor | bytes, remote_block_ids: Any, local_block_ids: Any,
             notif: str | None = None, timeout_s: float | None = None,
             lease_deadline_unix: float | None = None,
             expected_checksums: Sequence[int] | None = None) -> TransferStats:
        """Copies remote block ``remote_block_ids[i]`` into local block
        ``local_block_ids[i]`` and returns once every byte has landed; then, if
        ``notif`` (the lease id the blocks were lent under) is given, tells the
        owner so it can release them.  With no blocks it only notifies.

        ``lease_deadline_unix`` (owner's time.time() when the lease ends) bounds
        a pull that reads: none starts within LEASE_SAFETY_MARGIN_S of it, the
        timeout shrinks to fit, bytes landing after it are refused.  Such a pull
        raises LeaseExpiredError and sends no notification: the lease expires
        anyway, and a late release could free a new lease of the same id (the
        request prefilled again) under the puller reading it.

        ``expected_checksums`` (the owner's ``checksums(remote_block_ids)`` at
        hand-off, one per block) are checked once the bytes landed: a block
        that differs raises TransferCorruptError and sends no notification
        (the owner's block changed under the read: never commit it).

        Raises TransferError (LayoutMismatchError at a first handshake) when the
        pull cannot complete within ``timeout_s``; the local blocks then hold
        garbage and go back to the pool.  ValueError means a caller bug (ids out
        of range, a local block named twice)."""
        pool, _ = self._require_pool()
        desc = self._peer_descriptor(peer)
        remote_ids, local_ids = as_block_ids(remote_block_ids), as_block_ids(local_block_ids)
        check_block_ids(remote_ids, local_ids, desc.num_blocks, pool.shape[0])
        payload = self._notification(desc, notif) if notif is not None else b""
        if expected_checksums is not None and len(expected_checksums) != len(remote_ids):
            raise ValueError(f"{len(expected_checksums)} checksums for {len(remote_ids)} blocks")
        runs = coalesce_block_runs(remote_ids, local_ids)
        # Nothing read, nothing to protect: a notify-only pull ignores the deadline.
        lease = LeaseClock(lease_deadline_unix if runs else None, notif, desc.peer_id)
        deadline = Deadline(lease.clamp_timeout_s(timeout_s or self.timeout_s),
                            f"pull of {len(remote_ids)} blocks from {desc.peer_id} over {self.name}")
        started = time.perf_counter()

        def transfer(conn: Any) -> None:
            if runs:
                self._read_runs(conn, desc, runs, notif, deadline)
                lease.check_landed()
                if expected_checksums is not None:
                    self._verify(desc, local_ids, expected_checksums)
            if payload:
                self._notify(conn, desc, payload, deadline)

        self._exchange(desc, deadline, lease, len(remote_ids), transfer)
        seconds = time.perf_counter() - started
        return TransferStats(self.name, desc.peer_id, len(remote_ids), len(remote_ids) * desc.block_bytes,
                             seconds, len(runs))

    def checksums(self, block_ids: Sequence[int]) -> tuple[int, ...]:
        """Checksums of this side's blocks (pdcluster.transfer.checksum): an owner hands them
        off with the lease, a puller passes them to pull() as ``expected_checksums``."""
        pool, _ = self._require_pool()
        return block_checksums(pool, block_ids)

    def _verify(self, desc: PeerDescriptor, local_ids: Sequence[int], expected: Sequence[int]) -> None:
        pool, _ = self._require_pool()
        bad = first_mismatch(expected, block_checksums(pool, local_ids))
        if bad is not None:
            self.num_corrupt_pulls += 1
            raise TransferCorruptError(
                f"block {bad} of {len(local_ids)} pulled from {desc.peer_id} differs from what it handed off (its "
                "checksum): the block changed under the read. Free the local blocks and prefill again")

    def release(self, peer: PeerDescriptor | bytes, lease_id: str, timeout_s: float | None = None) -> None:
        """Tells the owner this side will not pull (more) under ``lease_id``, so
        it frees the blocks now rather than at expiry.  Unacknowledged: raises
        TransferError only when the transport notices the owner is gone; an
        undelivered release costs nothing but the wait for the lease to expire."""
        self._require_pool()  # the handshake compares layouts
        desc = self._peer_descriptor(peer)
        payload = self._notification(desc, lease_id)
        deadline = Deadline(timeout_s or self.timeout_s,
                            f"release of lease {lease_id!r} on {desc.peer_id} over {self.name}")
        self._exchange(desc, deadline, LeaseClock(None, lease_id, desc.peer_id), 0,
                       lambda conn: self._notify(conn, desc, payload, deadline))

    def poll_notifications(self) -> list[Notification]:
        """Lease ids pullers have finished with since the last call (never blocks).
        A malformed one, or with a secret one whose tag is missing or wrong, is
        dropped, counted in ``num_rejected_notifications`` and logged without
        its payload."""
        out = []
        for sender, payload in self._raw_notifications():
            try:
                note = decode_notification(sender, payload)
            except TransferError as e:
                self._reject_notification("ignoring a malformed transfer notification: %s", e)
                continue
            if self._secret is not None and not self._secret.verify(
                    note.tag, LEASE_RELEASE, note.from_peer, self.peer_id, self.epoch, note.lease_id):
                self._reject_notification("dropping a lease release that failed authentication: from=%r reason=%s",
                                          sender[:140], "no tag" if note.tag is None else "wrong tag")
                continue
            out.append(Notification(note.from_peer, note.lease_id))
        return out

    def wait_notifications(self, timeout_s: float) -> list[Notification]:
        """poll_notifications once one arrived, or after ``timeout_s`` (then often
        none): a loop that releases leases wakes when there is work, not every few ms."""
        self._arrived.wait(timeout_s)
        self._arrived.clear()  # one arriving from here on sets it again: the next wait returns at once
        return self.poll_notifications()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._arrived.set()  # a waiter returns now
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for cached in peers:
            self._disconnect(cached.conn)
        self._close()

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- peer cache -------------------------------------------------------

    def _exchange(self, desc: PeerDescriptor, deadline: Deadline, lease: LeaseClock, num_blocks: int,
                  transfer: Callable[[Any], None]) -> None:
        """Runs ``transfer`` on the peer's connection: a failed connection is
        dropped (the next call re-handshakes), and any failure after the lease's
        read time ran out becomes LeaseExpiredError."""
        conn = None
        try:
            conn = self._connection(desc, deadline)
            transfer(conn)
        except TransferInDoubtError as e:  # keep the connection: the READ on it must be able to end
            log.error("kv transfer in doubt: peer=%s backend=%s lease=%s blocks=%d error=%s",
                      desc.peer_id, self.name, lease.lease_id, num_blocks, e)
            raise
        except TransferCorruptError as e:  # the connection is fine: the owner's block changed
            log.error("kv transfer corrupt: peer=%s backend=%s lease=%s blocks=%d error=%s",
                      desc.peer_id, self.name, lease.lease_id, num_blocks, e)
            raise
        except LeaseExpiredError as e:  # the connection is fine: the owner refused, or we did
            log.warning("kv transfer lease expired: peer=%s backend=%s lease=%s blocks=%d error=%s",
                        desc.peer_id, self.name, lease.lease_id, num_blocks, e)
            raise
        except (TransferError, OSError) as e:
            if conn is not None:
                self._forget(desc, conn)
            log.warning("kv transfer failed: peer=%s backend=%s blocks=%d error=%s",
                        desc.peer_id, self.name, num_blocks, e)
            if lease.ran_out(deadline):  # a timeout's own advice (retry, raise the timeout) would mislead
                cause = "" if deadline.expired() else f": {e}"
                raise lease.expired(f"the read did not finish in the lease's time{cause}") from e
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"{deadline.what} failed: {e}; free the local blocks and retry") from e

    def _connection(self, desc: PeerDescriptor, deadline: Deadline) -> Any:
        with self._peers_lock:
            lock = self._peer_locks.setdefault(desc.peer_id, threading.Lock())
        if not lock.acquire(timeout=max(deadline.remaining_s(), 0.0)):
            raise deadline.timeout_error()
        try:
            cached = self._peers.get(desc.peer_id)
            if cached is not None and cached.epoch == desc.epoch:
                cached.last_used = time.monotonic()
                return cached.conn
            if cached is not None:
                log.info("kv transfer peer restarted: peer=%s epoch=%x->%x; re-handshaking",
                         desc.peer_id, cached.epoch, desc.epoch)
                self._forget(desc, cached.conn)
            conn = self._handshake(desc, deadline)
            with self._peers_lock:
                self._peers[desc.peer_id] = _CachedPeer(desc.epoch, conn, time.monotonic())
        finally:
            lock.release()
        self._forget_idle_peers(keep=desc.peer_id)  # a new peer came: those long unused most likely left
        return conn

    def _forget_idle_peers(self, keep: str) -> None:
        """Drops what is kept per peer -- its connection (NIXL: its loaded remote
        agent), its lock -- for peers unused for ``peer_idle_s``: replicas come
        and go, and a peer that comes back only handshakes again."""
        now = time.monotonic()
        with self._peers_lock:
            idle = [(peer_id, cached) for peer_id, cached in self._peers.items()
                    if peer_id != keep and now - cached.last_used > self.peer_idle_s]
            for peer_id, _ in idle:
                del self._peers[peer_id]
            for peer_id in [p for p, lock in self._peer_locks.items()
                            if p != keep and p not in self._peers and not lock.locked()]:
                del self._peer_locks[peer_id]
        for peer_id, cached in idle:
            log.info("kv transfer peer idle for over %.0f s: peer=%s; dropping its connection", self.peer_idle_s,
                     peer_id)
            self._disconnect(cached.conn)

    def _handshake(self, desc: PeerDescriptor, deadline: Deadline) -> Any:
        if self._closed:
            raise TransferError(f"{self.name} backend {self.peer_id} is closed; create a new one")
        if desc.backend != self.name:
            raise TransferError(
                f"peer {desc.peer_id} serves its pool over the {desc.backend!r} transfer backend but this side "
                f"({self.peer_id}) uses {self.name!r}; configure the same transfer backend on every replica")
        _, layout = self._require_pool()
        check_compatible(layout, desc.layout, self.peer_id, desc.peer_id)
        try:
            conn = self._connect(desc, deadline)
        except OSError as e:
            raise TransferError(f"cannot reach peer {desc.peer_id} ({e}); is it running?") from e
        self.num_handshakes += 1
        log.info("kv transfer handshake: peer=%s epoch=%x backend=%s", desc.peer_id, desc.epoch, self.name)
        return conn

    def _forget(self, desc: PeerDescriptor, conn: Any) -> None:
        with self._peers_lock:
            cached = self._peers.get(desc.peer_id)
            if cached is not None and cached.conn is conn:
                del self._peers[desc.peer_id]
            else:
                cached = None
        if cached is not None:
            self._disconnect(conn)

    def _peer_descriptor(self, peer: PeerDescriptor | bytes) -> PeerDescriptor:
        """The descriptor, its signature checked when a secret is set (before any field is used).
        Encoded descriptors already checked are remembered: a pull decodes and verifies nothing twice."""
        if isinstance(peer, bytes) and (known := self._checked_descriptors.get(peer)) is not None:
            return known
        desc = _as_descriptor(peer)
        if self._secret is not None and not self._secret.verify(desc.signature, DESCRIPTOR, desc.body()):
            state = "is not signed" if not desc.signature else "carries a wrong signature"
            raise AuthenticationError(
                f"the descriptor of peer {desc.peer_id} {state}: it was not made by a replica holding this "
                "cluster's secret. Check that every replica is given the same secret; never pull from it")
        if isinstance(peer, bytes):
            if len(self._checked_descriptors) >= _MAX_CHECKED_DESCRIPTORS:
                self._checked_descriptors.clear()  # peers restarted many times: start over
            self._checked_descriptors[peer] = desc
        return desc

    def _reject_notification(self, message: str, *args: Any) -> None:
        with self._peers_lock:
            self.num_rejected_notifications += 1
            rejected = self.num_rejected_notifications
        log.warning(message + " backend=%s rejected_total=%d", *args, self.name, rejected)

    def _notification(self, desc: PeerDescriptor, lease_id: str) -> bytes:
        check_lease_id(lease_id)
        tag = None if self._secret is None else self._secret.mac(LEASE_RELEASE, self.peer_id, desc.peer_id,
                                                                  desc.epoch, lease_id)
        return encode_notification(lease_id, tag)

    def _require_pool(self) -> tuple[torch.Tensor, KVLayout]:
        if self._closed:
            raise TransferError(f"{self.name} backend {self.peer_id} is closed; create a new one")
        if self._pool is None or self._layout is None:
            raise RuntimeError("call register_pool(kv_pool, layout) before describe() or pull()")
        return self._pool, self._layout

    # ---- backend hooks ----------------------------------------------------

    @abstractmethod
    def _register(self, kv_pool: torch.Tensor, layout: KVLayout, lease_guard: LeaseGuard | None) -> None:
        """Starts serving the pool; a backend that ``checks_lease_on_read`` keeps the guard."""

    @abstractmethod
    def _describe_fields(self) -> dict[str, Any]:
        """PeerDescriptor fields beyond the common ones (endpoint, pool_addr, ...)."""

    @abstractmethod
    def _connect(self, desc: PeerDescriptor, deadline: Deadline) -> Any:
        """Handshake with a peer; the result is cached until the epoch changes or a pull fails."""

    @abstractmethod
    def _disconnect(self, conn: Any) -> None: ...

    @abstractmethod
    def _read_runs(self, conn: Any, desc: PeerDescriptor, runs: list[BlockRun], lease_id: str | None,
                   deadline: Deadline) -> None:
        """Copies the runs, returning once every byte landed; ``lease_id`` is the
        lease they are read under (for an owner that checks it).  Notifying is
        the base class's job: only it knows whether the bytes landed in time."""

    @abstractmethod
    def _notify(self, conn: Any, desc: PeerDescriptor, notif_payload: bytes, deadline: Deadline) -> None: ...

    @abstractmethod
    def _raw_notifications(self) -> list[tuple[str, bytes]]:
        """(sender peer_id, payload) received since the last call."""

    @abstractmethod
    def _close(self) -> None: ...


def _as_descriptor(peer: PeerDescriptor | bytes) -> PeerDescriptor:
    return peer if isinstance(peer, PeerDescriptor) else PeerDescriptor.decode(peer)


def default_peer_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:100] or "host"
    return f"{host}-{os.getpid()}"
