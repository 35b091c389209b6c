"""The puller's half of a pull served as a NIXL WRITE (see pdcluster.transfer.nixl_writer
for the owner's, pdcluster.transfer.write_request for the messages).

The puller sends one signed request per pull and waits, progressing its own
UCX worker (which receives the WRITE's bytes over TCP), for the owner's
"wrote" notification of that seq: ok once every byte landed, or a typed
refusal.  When its deadline passes it sends a cancellation and raises; the
owner stops either way when the request's ``ttl`` runs out on its own clock,
counted from its receipt (write_request): the ttl is the remaining wait less
OWNER_STOP_MARGIN_S, so no byte lands after the caller freed its blocks as
long as the request reaches the owner's ticker within that margin.  No time of
day crosses the wire: the hosts' clocks may disagree.  And should a request be
slower than that margin, a pull that timed out before the owner answered
raises TransferInDoubtError: its blocks are held (the decode replica's
quarantine) until the owner's late answer to that seq says it stopped."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.errors import TransferError, TransferInDoubtError
from pdcluster.transfer.nixl_host import NixlHost
from pdcluster.transfer.lease_guard import lease_expired_error
from pdcluster.transfer.peer import PeerDescriptor
from pdcluster.transfer.runs import BlockRun, local_ids_of
from pdcluster.transfer.write_request import (MAX_TTL_S, PING, PING_INTERVAL_S, WriteDone, WriteRequest, sign_cancel,
                                    sign_request, verify)


log = logging.getLogger("pdcluster.transfer")
_SPIN_S = 200e-6
_MAX_SLEEP_S = 200e-6  # the worker must keep draining the socket while the WRITE arrives
# The owner gives up this long (at most a quarter of the wait) before the puller: it must cover the
# request's transit and the owner's ticker delay (progress_interval_s), which its ttl does not see.
OWNER_STOP_MARGIN_S = 0.25
_ANSWER_GRACE_S = 30.0  # past the request's ttl, a missing answer no longer holds the puller's blocks


class WriteMailbox:
    """The owner's answers, by seq, for the pulls waiting on them (filled while
    routing notifications, taken by the waiting thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_seq = 0
        self._waiting: set[int] = set()
        self._answers: dict[int, tuple[str, WriteDone]] = {}
        # Pulls that gave up without an answer: seq -> time.monotonic() after which it counts as
        # settled anyway (the owner stops on its own; an answer lost in transit must not hold blocks for ever).
        self._doubtful: dict[int, float] = {}

    def open(self) -> int:
        with self._lock:
            self._next_seq += 1
            self._waiting.add(self._next_seq)
            return self._next_seq

    def deliver(self, sender: str, done: WriteDone) -> None:
        with self._lock:
            if done.seq in self._waiting:
                self._answers[done.seq] = (sender, done)
            else:  # a late answer to a pull that gave up: the owner is done with it
                self._doubtful.pop(done.seq, None)

    def doubt(self, seq: int, settle_by_s: float) -> Callable[[], bool]:
        """``seq``'s puller gave up with no answer: whether the owner has finished
        with it (its answer came, or ``settle_by_s`` passed) is the returned check."""
        with self._lock:
            if seq not in self._answers:  # an answer that came just now settles it
                self._doubtful[seq] = time.monotonic() + settle_by_s
        return lambda: self._settled(seq)

    def _settled(self, seq: int) -> bool:
        with self._lock:
            until = self._doubtful.get(seq)
            if until is not None and time.monotonic() >= until:
                del self._doubtful[seq]
                log.warning("kv nixl write seq=%d: no answer from the owner %.0f s after the puller gave up; "
                            "its blocks go back", seq, _ANSWER_GRACE_S)
                until = None
            return until is None

    def take(self, seq: int) -> tuple[str, WriteDone] | None:
        with self._lock:
            return self._answers.pop(seq, None)

    def close(self, seq: int) -> None:
        with self._lock:
            self._waiting.discard(seq)
            self._answers.pop(seq, None)


def pull_by_write(backend: NixlHost, desc: PeerDescriptor, runs: list[BlockRun], lease_id: str | None,
                  deadline: Deadline) -> None:
    """Asks ``desc``'s owner to WRITE ``runs`` into this side's pool; returns once they landed."""
    ttl_s = owner_ttl_s(deadline.socket_timeout_s())  # raises once no wait is left
    mailbox = backend._mailbox
    seq = mailbox.open()
    req = sign_request(WriteRequest(seq, lease_id, tuple(runs), ttl_s, backend._own_descriptor()),
                       backend._secret, backend.agent_name, desc.agent_name)
    sent = False
    try:
        backend._send(desc, req.encode(), deadline)
        sent = True
        sender, done = _await(backend, seq, deadline, desc)
    except BaseException as exc:
        _cancel(backend, desc, seq)
        if sent and deadline.expired():
            # The owner may still be writing (its ttl counts from when it received the request): the
            # blocks are held until its answer to this seq says it stopped.
            local_ids = local_ids_of(runs)
            raise TransferInDoubtError(
                f"{deadline.what} timed out before the owner answered: it may still write the {len(local_ids)} "
                "local blocks; hold them until it answers", local_ids,
                mailbox.doubt(seq, ttl_s + _ANSWER_GRACE_S)) from exc
        raise
    finally:
        mailbox.close(seq)
    if sender != desc.agent_name or not verify(done, backend._secret, sender, backend.agent_name):
        raise TransferError(f"{deadline.what}: the answer did not come from {desc.peer_id} of this cluster "
                            "(wrong sender or tag); free the local blocks and fetch its current descriptor")
    if done.ok:
        return
    if done.code == "lease_expired":
        raise lease_expired_error(lease_id, desc.peer_id, f"the owner refused: {done.error}")
    raise TransferError(f"{deadline.what} refused by the owner ({done.code}: {done.error}); "
                        "free the local blocks and retry, or prefill again")


def owner_ttl_s(wait_s: float) -> float:
    """The request's time-to-live for a puller that waits ``wait_s`` (> 0) more."""
    return min(wait_s - min(OWNER_STOP_MARGIN_S, wait_s / 4), MAX_TTL_S)


def _await(backend: NixlHost, seq: int, deadline: Deadline, desc: PeerDescriptor) -> tuple[str, WriteDone]:
    """The owner's answer to ``seq``; TransferError at the deadline, or as soon as
    a ping finds the owner gone (nothing of ours is outstanding on the connection
    otherwise: UCX would not tell)."""
    spin_until = time.perf_counter() + _SPIN_S
    ping_at = time.monotonic() + PING_INTERVAL_S
    sleep_s = 20e-6
    while True:
        backend._collect_notifications()  # progresses the worker: the WRITE's bytes land meanwhile
        answer = backend._mailbox.take(seq)
        if answer is not None:
            return answer
        deadline.check()
        if time.monotonic() >= ping_at:
            backend._send(desc, PING, deadline)
            ping_at = time.monotonic() + PING_INTERVAL_S
        if time.perf_counter() > spin_until:
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 1.5, _MAX_SLEEP_S)


def _cancel(backend: NixlHost, desc: PeerDescriptor, seq: int) -> None:
    """Best effort: the owner stops when the request's ttl runs out anyway."""
    msg = sign_cancel(seq, backend._secret, backend.agent_name, desc.agent_name)
    try:
        backend._send(desc, msg.encode(), Deadline(1.0, f"cancel of write {seq}"))
    except TransferError:
        pass
