"""Errors of the transfer layer.  Every message says which peer, what went
wrong and what to do next; the serving layer logs them as they are."""

from __future__ import annotations

from collections.abc import Callable


class TransferError(RuntimeError):
    """A pull did not complete: the peer died, stalled past the timeout, sent
    something malformed or refused us.  The local blocks named in the pull hold
    garbage and must go back to the pool; the remote side's lease will expire."""


class LayoutMismatchError(TransferError):
    """The two pools do not hold the same kind of KV blocks (model, dtype,
    geometry); refused at handshake, before any byte moves."""


class BackendUnavailableError(TransferError):
    """A backend cannot run here (library missing, no usable transport)."""


class ConnectionClosedError(TransferError):
    """The other side closed a socket mid-message (it died, or gave up)."""


class FrameTooLargeError(TransferError):
    """A frame's length prefix is over the reader's limit; its body was not
    read (nor allocated), and the connection is unusable."""


class LeaseExpiredError(TransferError):
    """The owner's lease on the blocks ran out before (or while) they were read,
    or the owner does not know it: the blocks may already hold another
    request's KV.  Nothing read may be used; the request must be prefilled
    again (a retry of the same pull cannot succeed)."""


class AuthenticationError(TransferError):
    """The other side did not prove it holds this cluster's secret (or refused
    our proof), or a peer descriptor's signature is wrong: a replica started
    with another secret, or an impostor.  Retrying cannot help; check that
    every replica of the cluster is given the same secret."""


class TransferCorruptError(TransferError):
    """The bytes landed, but a block differs from what the owner handed off
    (its checksum): never use them.  The owner's block changed after the
    hand-off (its lease was released early and the block reused) or the
    read was torn; prefill again."""


class TransferInDoubtError(TransferError):
    """The pull failed and its transport could not confirm the transfer
    stopped (NIXL could not cancel an active READ): bytes may still land in
    ``local_block_ids``.  Hold those blocks out of reuse -- not freed, not
    cached -- until ``settled()`` returns True; every other block of the
    pull goes back as usual."""

    def __init__(self, message: str, local_block_ids: tuple[int, ...], settled: Callable[[], bool]) -> None:
        super().__init__(message)
        self.local_block_ids = local_block_ids
        self.settled = settled
