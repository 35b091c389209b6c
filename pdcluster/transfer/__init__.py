"""KV block transfer between replicas: a NIXL backend and a portable socket
fallback behind one interface (see pdcluster.transfer.base for the call sequence).

    backend = create_backend(config_name, secret=cluster_secret)  # "auto" | "nixl" | "fallback"; >= 16 bytes
    kv_pool = allocate_kv_pool(num_blocks, layout)   # optional: huge pages double same-host NIXL bandwidth
    backend.register_pool(kv_pool, KVLayout.of_pool(kv_pool, model_fingerprint), lease_guard=lease_table)
    descriptor = backend.describe()                  # owner: hand out once
    stats = backend.pull(descriptor, remote_ids, local_ids, notif=lease_id,
                         lease_deadline_unix=deadline)  # puller; LeaseExpiredError: prefill again
    backend.release(descriptor, lease_id)            # puller that will not pull after all
    for n in backend.poll_notifications(): lease_table.release(n.lease_id)  # owner

The names below load their module on first use (module ``__getattr__``), so
importing a light submodule -- ``pdcluster.transfer.auth`` for the cluster
secret, as the gateway's token inbox does -- loads no backend and no torch.
"""

from __future__ import annotations

from types import ModuleType

_EXPORTS = {  # module under pdcluster.transfer -> the names it exports here
    "base": ("TransferBackend", "TransferStats"),
    "errors": ("AuthenticationError", "BackendUnavailableError", "LayoutMismatchError", "LeaseExpiredError",
               "TransferError"),
    "layout": ("KVLayout", "check_compatible"),
    "lease_guard": ("LEASE_SAFETY_MARGIN_S", "OWNER_FREE_GRACE_S", "LeaseGuard"),
    "peer": ("Notification", "PeerDescriptor"),
    "pool_alloc": ("allocate_kv_pool",),
    "registry": ("backend_class", "backend_names", "create_backend"),
    "runs": ("BlockRun", "coalesce_block_runs"),
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)


def __getattr__(name: str):
    home = next((module for module, names in _EXPORTS.items() if name in names), None)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_load(home), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _load(home: str) -> ModuleType:
    """Plain import statements, so that the layout tests read this package's imports."""
    if home == "base":
        import pdcluster.transfer.base as module
    elif home == "errors":
        import pdcluster.transfer.errors as module
    elif home == "layout":
        import pdcluster.transfer.layout as module
    elif home == "lease_guard":
        import pdcluster.transfer.lease_guard as module
    elif home == "peer":
        import pdcluster.transfer.peer as module
    elif home == "pool_alloc":
        import pdcluster.transfer.pool_alloc as module
    elif home == "registry":
        import pdcluster.transfer.registry as module
    else:
        import pdcluster.transfer.runs as module
    return module
