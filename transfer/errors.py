"""Errors of the transfer layer.  Every message says which peer, what went
wrong and what to do next; the serving layer logs them as they are."""

from __future__ import annotations


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
