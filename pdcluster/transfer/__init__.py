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
"""

from pdcluster.transfer.base import TransferBackend, TransferStats
from pdcluster.transfer.errors import (AuthenticationError, BackendUnavailableError, LayoutMismatchError, LeaseExpiredError,
                             TransferError)
from pdcluster.transfer.layout import KVLayout, check_compatible
from pdcluster.transfer.lease_guard import LEASE_SAFETY_MARGIN_S, OWNER_FREE_GRACE_S, LeaseGuard
from pdcluster.transfer.peer import Notification, PeerDescriptor
from pdcluster.transfer.pool_alloc import allocate_kv_pool
from pdcluster.transfer.registry import backend_class, backend_names, create_backend
from pdcluster.transfer.runs import BlockRun, coalesce_block_runs

__all__ = [
    "LEASE_SAFETY_MARGIN_S", "OWNER_FREE_GRACE_S",
    "AuthenticationError", "BackendUnavailableError", "BlockRun", "KVLayout", "LayoutMismatchError",
    "LeaseExpiredError", "LeaseGuard",
    "Notification", "PeerDescriptor", "TransferBackend", "TransferError", "TransferStats", "allocate_kv_pool",
    "backend_class", "backend_names", "check_compatible", "coalesce_block_runs", "create_backend",
]
