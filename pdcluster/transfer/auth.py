"""The cluster secret and every MAC made with it.

One secret per cluster (>= MIN_SECRET_BYTES random bytes, the same on every
replica) keys HMAC-SHA256 over a label and the message's fields, so a tag
made for one purpose is never accepted for another:

    "puller-proof"   server nonce, client nonce, puller id, owner id   socket auth, puller -> owner
    "owner-proof"    the same fields                                   socket auth, owner -> puller
    "descriptor"     PeerDescriptor.body()                             describe() signs, pull() verifies
    "lease-release"  sender id, owner id, owner epoch, lease id        a release notification
    "write-request"  puller agent, owner agent, the request's fields   NIXL write path, puller -> owner
    "write-done"     owner agent, puller agent, seq, ok, code, error   NIXL write path, owner -> puller
    "write-cancel"   puller agent, owner agent, seq                    NIXL write path, puller -> owner
    "token-sender"   inbox nonce, sender nonce, replica, inbox id      token channel, replica -> gateway
    "token-inbox"    the same fields                                   token channel, gateway -> replica
                     (pdcluster/services/token_channel.py; this module loads no backend)

Fields are packed as one msgpack list (length-prefixed, so no two field lists
encode alike).  The secret itself never leaves ClusterSecret: not in a repr,
an error, a log line or a pickle."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any, NoReturn

from pdcluster.transfer.wire import pack

MIN_SECRET_BYTES = 16
NONCE_BYTES = 32

PULLER_PROOF = "puller-proof"
OWNER_PROOF = "owner-proof"
DESCRIPTOR = "descriptor"
LEASE_RELEASE = "lease-release"
WRITE_REQUEST = "write-request"
WRITE_DONE = "write-done"
WRITE_CANCEL = "write-cancel"


class ClusterSecret:
    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, bytes):
            raise TypeError(f"the cluster secret must be bytes, got {type(secret).__name__}")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the cluster secret has {len(secret)} bytes, under the {MIN_SECRET_BYTES} required; "
                             "generate one with secrets.token_bytes(32)")
        self._key = secret

    @classmethod
    def of(cls, secret: bytes | None) -> ClusterSecret | None:
        return None if secret is None else cls(secret)

    def mac(self, label: str, *fields: Any) -> bytes:
        return hmac.new(self._key, pack([label, *fields]), hashlib.sha256).digest()

    def verify(self, tag: Any, label: str, *fields: Any) -> bool:
        """True when ``tag`` (untrusted: any type) is the MAC of these fields."""
        return isinstance(tag, bytes) and hmac.compare_digest(tag, self.mac(label, *fields))

    def __repr__(self) -> str:
        return "ClusterSecret(<redacted>)"

    def __reduce__(self) -> NoReturn:
        raise TypeError("a ClusterSecret is not pickled; hand each process the secret through its own config")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def is_nonce(value: Any) -> bool:
    return isinstance(value, bytes) and len(value) == NONCE_BYTES
