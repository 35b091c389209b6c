"""The per-cluster secret the KV peers authenticate each other with.

    LocalCluster.start()                      replica (prefill, decode, gateway)
    ensure_cluster_secret()                   cluster_secret() -> 32 bytes
      PDCLUSTER_CLUSTER_SECRET=<64 hex>  ──►    create_backend(..., secret=cluster_secret())
      in the driver's environment,
      inherited by Ray's daemons and workers

It travels by inheritance only, never in Ray's ``runtime_env``: Ray's
runtime-env agent writes every runtime_env it sets up, env_vars included,
into its log (``runtime_env_agent.log``), and the dashboard shows a job's
runtime_env to anyone who can reach it.  Nothing prints it; an operator who
wants one secret across restarts (or across hosts) sets the variable
before `pdcluster up`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
import secrets

CLUSTER_SECRET_ENV = "PDCLUSTER_CLUSTER_SECRET"
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
_HOW_TO_MAKE_ONE = "python -c 'import secrets; print(secrets.token_hex(32))'"


def new_cluster_secret() -> str:
    """A fresh secret, hex-encoded as it travels in the environment."""
    return secrets.token_bytes(SECRET_BYTES).hex()


def cluster_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """This cluster's secret from ``environ`` (default: this process's), None
    when none is set (the peers run unauthenticated).  Raises ValueError,
    without echoing the value, when it is malformed."""
    value = (os.environ if environ is None else environ).get(CLUSTER_SECRET_ENV, "").strip()
    if not value:
        return None
    try:
        secret = bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{CLUSTER_SECRET_ENV} is not hex: set it to {MIN_SECRET_BYTES}+ random bytes "
                         f"in hex, e.g. `{_HOW_TO_MAKE_ONE}`, or unset it to get a fresh one") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{CLUSTER_SECRET_ENV} holds {len(secret)} bytes; use at least {MIN_SECRET_BYTES}, "
                         f"e.g. `{_HOW_TO_MAKE_ONE}`")
    return secret


def ensure_cluster_secret() -> bool:
    """Sets a fresh secret in this process's environment unless one is set
    (and checks a given one); returns whether it set one (so the caller can
    take it away again when its cluster stops)."""
    if cluster_secret() is not None:
        return False
    os.environ[CLUSTER_SECRET_ENV] = new_cluster_secret()
    return True
