"""What Serve's config says about the Redis URL: a reference, never the password.

Everything bound into a deployment (its arguments, ``request_router_kwargs``)
is readable at the Ray dashboard's ``/api/serve/applications/``, and a Redis
URL carries its password.  The driver binds a reference; each replica (and
the router inside the gateway) resolves it itself::

    driver                                    Serve's config           replica
    redis://host:6379/0 (no password)   ──►   the URL as it is    ──►  itself
    URL == $REDIS_URL (a Secret, KubeRay) ──► env:REDIS_URL       ──►  $REDIS_URL
    any other URL with a password       ──►   sealed:<token>      ──►  opened with the cluster secret

``sealed:`` is the URL encrypted (AES-SIV, authenticated) under a key derived
from the cluster secret (pdcluster/services/cluster_secret.py checks and sets it; read
here by name, as the router cannot import services), which every node
already holds by inheritance; without the secret the token is useless.
AES-SIV is deterministic: the same URL seals to the same token, so the
deployments' versions (app.py ``_versioned``) stay put across a rescale.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Mapping
from urllib.parse import urlsplit


ENV_PREFIX = "env:"
SEALED_PREFIX = "sealed:"
URL_ENV_NAMES = ("REDIS_URL",)  # variables a deployment gives every replica (a Kubernetes Secret)
_KEY_CONTEXT = b"pdcluster index url v1"
CLUSTER_SECRET_ENV = "PDCLUSTER_CLUSTER_SECRET"  # pdcluster/services/cluster_secret.py's


class IndexUrlError(ValueError):
    """The index URL cannot be passed, or read back, without its password in Serve's config."""


def cluster_secret(environ: Mapping[str, str]) -> bytes | None:
    value = environ.get(CLUSTER_SECRET_ENV, "").strip()
    if not value:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise IndexUrlError(f"{CLUSTER_SECRET_ENV} is not hex: see `pdcluster up --help` for making one") from None


def has_password(url: str) -> bool:
    return bool(urlsplit(url).password)


def _cipher(secret: bytes):
    from cryptography.hazmat.primitives.ciphers.aead import AESSIV

    return AESSIV(hmac.new(secret, _KEY_CONTEXT, hashlib.sha512).digest())  # 64 bytes: AES-256-SIV


def index_url_reference(url: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The form of ``url`` that may go into Serve's config (see the module doc)."""
    env = os.environ if environ is None else environ
    if url is None or url.startswith((ENV_PREFIX, SEALED_PREFIX)) or not has_password(url):
        return url
    for name in URL_ENV_NAMES:
        if env.get(name) == url:
            return ENV_PREFIX + name
    secret = cluster_secret(env)
    if secret is None:
        raise IndexUrlError(f"index_url carries a password, which Serve's config would show on the dashboard: "
                            f"set {CLUSTER_SECRET_ENV} (the same on every node) to seal it, or give the URL as "
                            "REDIS_URL in every replica's environment")
    sealed = _cipher(secret).encrypt(url.encode(), None)
    return SEALED_PREFIX + base64.urlsafe_b64encode(sealed).decode()


def resolve_index_url(ref: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The URL a reference stands for, read in the replica; a plain URL is itself."""
    env = os.environ if environ is None else environ
    if ref is None or not ref.startswith((ENV_PREFIX, SEALED_PREFIX)):
        return ref
    if ref.startswith(ENV_PREFIX):
        name = ref[len(ENV_PREFIX):]
        value = env.get(name, "").strip()
        if not value:
            raise IndexUrlError(f"the index URL is to come from ${name}, which this replica's environment "
                                f"lacks: set {name} on every node (e.g. from the Redis Secret)")
        return value
    secret = cluster_secret(env)
    if secret is None:
        raise IndexUrlError(f"the index URL is sealed with the cluster secret, which this replica lacks: "
                            f"set {CLUSTER_SECRET_ENV} on this node, the same as on the head")
    from cryptography.exceptions import InvalidTag

    try:
        return _cipher(secret).decrypt(base64.urlsafe_b64decode(ref[len(SEALED_PREFIX):]), None).decode()
    except (InvalidTag, ValueError):
        raise IndexUrlError(f"the sealed index URL does not open with this node's {CLUSTER_SECRET_ENV}: "
                            "set the same secret on every node, then restart the cluster") from None
