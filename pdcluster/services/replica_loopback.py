"""Ray Serve 2.60 binds every replica's inter-deployment gRPC server to
``[::]:0`` (hard-coded in ``ray/serve/_private/replica.py``), so on a
loopback-only cluster each replica would still listen on all interfaces.
Replica constructors call :func:`bind_replica_grpc_to_loopback` -- Serve
starts that server only after the constructor returns -- and it binds
127.0.0.1 instead.  Multi-node clusters (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
not ``0``) keep Serve's behaviour."""

from __future__ import annotations

import os


def bind_replica_grpc_to_loopback() -> bool:
    """Returns whether the replica's gRPC server will bind loopback."""
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        return False
    from ray.serve._private import replica

    bind = replica.add_port_to_grpc_server
    if not getattr(bind, "loopback_only", False):
        def loopback_bind(server, address: str):
            return bind(server, address.replace("[::]", "127.0.0.1", 1))

        loopback_bind.loopback_only = True
        replica.add_port_to_grpc_server = loopback_bind
    return True
