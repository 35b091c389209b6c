"""The socket fallback's mutual challenge, both sides.  It opens every
connection to a block server, before anything that tells of the pool:

    owner  -> {"op": "challenge", "nonce": sn}                sent first, unasked
    puller -> {"op": "auth", "peer_id", "nonce": cn, "mac"}   mac = HMAC(secret, "puller-proof", sn, cn, puller, owner)
    owner  -> {"ok": true, "mac"}                             mac = HMAC(secret, "owner-proof",  sn, cn, puller, owner)
            | AUTH_REFUSAL, and the owner closes the connection

Fresh nonces from both sides make neither proof replayable; the owner's id in
both means the puller reached the peer its descriptor names.  The refusal is
the same bytes whatever was wrong.  Without a secret the macs are left out
and nobody checks them (tests, the bench)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from pdcluster.transfer.auth import OWNER_PROOF, PULLER_PROOF, ClusterSecret, is_nonce, new_nonce
from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.errors import AuthenticationError, ConnectionClosedError, TransferError
from pdcluster.transfer.peer import check_peer_id
from pdcluster.transfer.wire import MAX_REPLY_BYTES, recv_frame, send_frame

AUTH_REFUSAL = {"ok": False, "error": "authentication failed"}
HANDSHAKE_FRAME_BYTES = 1024  # the auth and hello frames: ids, nonces, a mac, a layout


class PullerRefused(Exception):
    """Owner side: the puller failed; it has been sent AUTH_REFUSAL and nothing else."""

    def __init__(self, claimed_peer_id: str | None) -> None:
        super().__init__("a puller failed authentication")
        self.claimed_peer_id = claimed_peer_id  # unproven: for the log only


def challenge_puller(sock: socket.socket, deadline: Deadline, secret: ClusterSecret | None, owner_id: str,
                     on_refused: Callable[[str | None], None] = lambda claimed: None) -> str:
    """Owner side: the puller's id once it proved it holds the secret (any
    well-formed id without one); raises PullerRefused otherwise. on_refused
    runs before the refusal is sent, so a puller that has read its refusal
    can already see the owner's count of it."""
    server_nonce = new_nonce()
    send_frame(sock, {"op": "challenge", "nonce": server_nonce}, deadline)
    auth = recv_frame(sock, deadline, "authentication", max_bytes=HANDSHAKE_FRAME_BYTES)
    puller = _claimed_peer_id(auth)
    if puller is None or (secret is not None and not secret.verify(
            auth.get("mac"), PULLER_PROOF, server_nonce, auth["nonce"], puller, owner_id)):
        on_refused(puller)
        try:
            send_frame(sock, AUTH_REFUSAL, deadline)
        except (OSError, TransferError):
            pass  # the refusal is a courtesy; the connection closes either way
        raise PullerRefused(puller)
    reply: dict[str, Any] = {"ok": True}
    if secret is not None:
        reply["mac"] = secret.mac(OWNER_PROOF, server_nonce, auth["nonce"], puller, owner_id)
    send_frame(sock, reply, deadline)
    return puller


def answer_challenge(sock: socket.socket, deadline: Deadline, secret: ClusterSecret | None, puller_id: str,
                     owner_id: str, owner_address: str) -> None:
    """Puller side: proves this side holds the secret and, with one, checks that
    the owner does too; raises AuthenticationError when either fails."""
    try:
        challenge = recv_frame(sock, deadline, f"challenge from {owner_id}", max_bytes=MAX_REPLY_BYTES)
    except ConnectionClosedError as e:
        raise TransferError(f"peer {owner_id} closed the connection unasked: it is at its connection cap "
                            "or shutting down; retry, or pull elsewhere") from e
    if not (isinstance(challenge, dict) and challenge.get("op") == "challenge" and is_nonce(challenge.get("nonce"))):
        raise TransferError(f"peer {owner_id} did not open with an authentication challenge; "
                            "both sides must run the same pdcluster")
    fields = (challenge["nonce"], new_nonce(), puller_id, owner_id)
    auth: dict[str, Any] = {"op": "auth", "peer_id": puller_id, "nonce": fields[1]}
    if secret is not None:
        auth["mac"] = secret.mac(PULLER_PROOF, *fields)
    send_frame(sock, auth, deadline)
    reply = recv_frame(sock, deadline, f"authentication reply from {owner_id}", max_bytes=MAX_REPLY_BYTES)
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        hint = ("this side was given no cluster secret: pass it as create_backend(..., secret=...)"
                if secret is None else "the two sides hold different cluster secrets, or the endpoint now "
                "belongs to another peer: check the secret every replica is given")
        raise AuthenticationError(f"peer {owner_id} refused this side's authentication; {hint}")
    if secret is not None and not secret.verify(reply.get("mac"), OWNER_PROOF, *fields):
        raise AuthenticationError(f"the owner at {owner_address} did not prove it is {owner_id} of this cluster "
                                  "(it holds no secret, another one, or is another peer); not pulling from it")


def _claimed_peer_id(auth: Any) -> str | None:
    """The peer id a well-formed auth frame claims, else None."""
    if not isinstance(auth, dict) or auth.get("op") != "auth" or not is_nonce(auth.get("nonce")):
        return None
    try:
        return check_peer_id(auth.get("peer_id"))
    except ValueError:
        return None
