"""The lease a pull reads under, as the transfer layer sees it.

A prefill replica lends a finished prompt's blocks under a lease (lease id ==
request id) that ends at ``lease_deadline_unix`` (time.time() on the owner):

    pin ─────────── reads allowed ───────────┤ deadline ├── grace ──┤ blocks freed
                                             │  reads refused        │  (maybe reused)
        puller starts a read only before ────┘                       │
        deadline - LEASE_SAFETY_MARGIN_S, and trusts its bytes only  │
        if they landed before the deadline ─── clocks may disagree by up to the grace

Two checks protect a pull, because one alone cannot:

- the owner's (``LeaseGuard``): a backend whose owner serves each read itself
  (the socket fallback) asks the guard before sending a byte and keeps the
  blocks pinned until the last byte left (begin_read .. end_read);
- the puller's (``LeaseClock``): on a one-sided backend (NIXL) the owner's
  CPU never sees the read, so the puller refuses to start it too late, bounds
  it by the lease, and discards bytes that landed after the deadline.

Reading recycled blocks would produce silently wrong output, the one failure
we never accept: every doubt ends in LeaseExpiredError and a new prefill."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.errors import LeaseExpiredError

LEASE_SAFETY_MARGIN_S = 0.25  # a read must be able to finish this long before the deadline
OWNER_FREE_GRACE_S = 1.0  # the owner frees a lease's blocks this long after its deadline (its side's contract)


class LeaseGuard(Protocol):
    """What the owner's lease table offers the transfer layer (the engine's
    LeaseTable implements it; both methods are called from server threads)."""

    def begin_read(self, lease_id: str, block_ids: Sequence[int]) -> str | None:
        """None: the read may go ahead and the blocks stay pinned until end_read;
        otherwise why not (unknown, released or expired lease, blocks outside it)."""

    def end_read(self, lease_id: str) -> None:
        """The read that begin_read allowed is over (finished or failed)."""


class LeaseClock:
    """The puller's view of one hand-off's deadline (``None``: no deadline known)."""

    def __init__(self, lease_deadline_unix: float | None, lease_id: str | None, peer_id: str) -> None:
        self.lease_deadline_unix = lease_deadline_unix
        self.lease_id = lease_id
        self.peer_id = peer_id
        self.bounds_timeout = False  # the lease, not the transfer timeout, set the pull's deadline

    def read_time_left_s(self) -> float | None:
        """Seconds a read may still take (deadline minus margin minus now); None without a deadline."""
        if self.lease_deadline_unix is None:
            return None
        return self.lease_deadline_unix - LEASE_SAFETY_MARGIN_S - time.time()

    def clamp_timeout_s(self, timeout_s: float) -> float:
        """``timeout_s``, or less if the lease ends sooner; raises if no read time is left."""
        left = self.read_time_left_s()
        if left is None:
            return timeout_s
        if left <= 0:
            raise self.expired(self._too_late())
        self.bounds_timeout = left < timeout_s
        return min(timeout_s, left)

    def ran_out(self, deadline: Deadline) -> bool:
        """True once the read time is over: by the clock, or because the pull's
        deadline (which the lease set) passed; either way retrying cannot help."""
        left = self.read_time_left_s()
        return left is not None and (left <= 0 or (self.bounds_timeout and deadline.expired()))

    def check_landed(self) -> None:
        """Raises if the bytes landed after the deadline: the owner may have refused
        or recycled the blocks by then, so they cannot be trusted."""
        now = time.time()
        if self.lease_deadline_unix is not None and now >= self.lease_deadline_unix:
            raise self.expired(f"the bytes landed {now - self.lease_deadline_unix:.3f} s after the lease's deadline")

    def _too_late(self) -> str:
        assert self.lease_deadline_unix is not None
        left_s = self.lease_deadline_unix - time.time()
        if left_s <= 0:
            return f"its deadline passed {-left_s:.3f} s before the read could start"
        return f"{left_s:.3f} s were left, under the {LEASE_SAFETY_MARGIN_S:g} s margin a read needs"

    def expired(self, why: str) -> LeaseExpiredError:
        return lease_expired_error(self.lease_id, self.peer_id, why)


def lease_expired_error(lease_id: str | None, peer_id: str, why: str) -> LeaseExpiredError:
    lease = f"lease {lease_id!r}" if lease_id is not None else "the lease"
    return LeaseExpiredError(
        f"the KV hand-off under {lease} from {peer_id} expired ({why}); its blocks may already hold "
        "another request's KV: free the local blocks and prefill the request again")
