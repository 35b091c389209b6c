"""NIXL backend: one READ per pull, issued by the puller (one-sided pull).

How it is set up, and why (measured with nixl 1.5.1 on a 2-core CPU host):

- No NIXL progress thread.  Its loop polls with a 0 ms timeout and keeps one
  core busy per agent even when idle.  The puller drives its own transfers by
  polling ``check_xfer_state``; a small ticker thread here (every
  ``progress_interval_s``) drives the owner side for transports that need it
  (TCP) and collects notifications.
- ``ucx_error_handling_mode="none"``: with the default ("peer") every READ
  waits for the owner's worker to make progress, so a busy or stopped owner
  stalls the pull; with "none" a same-host READ (UCX cma) completes without
  the owner, and a dead owner still surfaces as NIXL_ERR_REMOTE_DISCONNECT.
- Same-host READs copy inside ``transfer()`` (process_vm_readv), so the
  deadline is checked around NIXL calls, not inside that copy; the copy is
  bounded by the pull's size.
- Leases: the owner's CPU never sees a READ, so a LeaseGuard cannot be asked;
  the base class's lease deadline checks on the puller protect the read, and
  the notification goes out as a separate message only after they passed.
- With a cluster secret the base class signs the descriptor (whose agent
  metadata says which agent to connect to) and checks it in pull() before
  ``add_remote_agent``; notifications carry a tag.  The READs themselves are
  not authenticated: see transfer.base for what that leaves open.

Remote descriptors are built from the peer descriptor's ``pool_addr`` rather
than NIXL's pickled descriptor lists: nothing from the wire is unpickled."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from transfer.base import TransferBackend
from transfer.deadline import Deadline
from transfer.errors import BackendUnavailableError, TransferError
from transfer.layout import KVLayout
from transfer.lease_guard import LeaseGuard
from transfer.peer import PeerDescriptor, peer_id_of_agent
from transfer.runs import BlockRun, runs_to_regions

log = logging.getLogger("pdcluster.transfer")

_SPIN_S = 200e-6  # poll without sleeping this long: small pulls finish in ~50 us
_MAX_SLEEP_S = 1e-3


def _load_nixl() -> tuple[Any, Any]:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # ImportError, or a broken native library
        raise BackendUnavailableError(
            f"nixl does not import here ({type(e).__name__}: {e}); `pip install nixl`, "
            "or set the transfer backend to 'fallback'") from e
    return nixl_agent, nixl_agent_config


class NixlBackend(TransferBackend):
    name = "nixl"
    one_sided = True  # on same-host CMA and RDMA; over plain TCP the owner's ticker serves it
    device_memory = True
    needs_listener = False
    checks_lease_on_read = False  # one-sided: the puller's deadline checks stand in (see transfer.base)

    def __init__(self, peer_id: str | None = None, timeout_s: float = 10.0, secret: bytes | None = None,
                 progress_interval_s: float | None = 0.005, ucx_error_handling: str = "none",
                 net_devices: str | None = None) -> None:
        """``net_devices``: UCX_NET_DEVICES for this process's agents (``lo``, or
        the device of the address peers reach this host on); None keeps the environment's."""
        super().__init__(peer_id, timeout_s, secret)
        nixl_agent, nixl_agent_config = _load_nixl()
        if net_devices is not None:  # UCX reads it when the agent's context starts, just below
            os.environ["UCX_NET_DEVICES"] = net_devices
        try:
            self._agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=[]))
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_handling})
        except Exception as e:
            raise BackendUnavailableError(
                f"NIXL could not start a UCX backend here ({type(e).__name__}: {e}); "
                "check UCX_NET_DEVICES/UCX_TLS, or set the transfer backend to 'fallback'") from e
        self._lock = threading.Lock()  # the agent runs in NIXL_THREAD_SYNC_NONE mode
        self._inbox: list[tuple[str, bytes]] = []
        self._progress_interval_s = progress_interval_s
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._reg_descs: Any = None
        self._mem_type = "DRAM"
        self._device_id = 0

    # ---- owner side -------------------------------------------------------

    def _register(self, kv_pool: torch.Tensor, layout: KVLayout, lease_guard: LeaseGuard | None) -> None:
        self._mem_type = "DRAM" if kv_pool.device.type == "cpu" else "VRAM"
        self._device_id = kv_pool.device.index or 0
        with self._lock:
            try:
                self._reg_descs = self._agent.register_memory(kv_pool)
            except Exception as e:
                raise TransferError(f"NIXL could not register the KV pool ({type(e).__name__}: {e})") from e
        if self._progress_interval_s:
            self._ticker = threading.Thread(target=self._tick, name=f"kv-nixl-progress-{self.peer_id}",
                                            daemon=True)
            self._ticker.start()

    def _describe_fields(self) -> dict[str, Any]:
        assert self._pool is not None
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        return {"mem_type": self._mem_type, "device_id": self._device_id, "pool_addr": self._pool.data_ptr(),
                "agent_metadata": bytes(metadata)}

    def _tick(self) -> None:
        while not self._stop.wait(self._progress_interval_s):
            self._collect_notifications()

    def _collect_notifications(self) -> None:
        with self._lock:
            if self._agent is None:
                return
            try:
                fresh = self._agent.get_new_notifs()
            except Exception as e:
                log.warning("nixl notification poll failed: %s", e)
                return
            for sender, payloads in fresh.items():
                sender = sender.decode() if isinstance(sender, bytes) else sender
                self._inbox.extend((peer_id_of_agent(sender), bytes(p)) for p in payloads)

    def _raw_notifications(self) -> list[tuple[str, bytes]]:
        self._collect_notifications()
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    # ---- puller side ------------------------------------------------------

    def _connect(self, desc: PeerDescriptor, deadline: Deadline) -> str:
        with self._lock:
            try:
                name = self._add_remote_agent(desc)
                if name != desc.agent_name:
                    self._drop_remote_agent(name)
                    raise TransferError(f"peer descriptor of {desc.peer_id} carries metadata of agent {name!r}, "
                                        f"not {desc.agent_name!r}; fetch a fresh descriptor")
                self._agent.make_connection(name)
            except TransferError:
                raise
            except Exception as e:
                raise TransferError(f"NIXL handshake with {desc.peer_id} failed ({type(e).__name__}: {e}); "
                                    "is the peer running the same nixl version?") from e
        return name

    def _add_remote_agent(self, desc: PeerDescriptor) -> str:
        """Loads the peer's metadata; once more after dropping a stale copy NIXL still holds."""
        try:
            name = self._agent.add_remote_agent(desc.agent_metadata)
        except Exception:
            if not self._drop_remote_agent(desc.agent_name):
                raise
            name = self._agent.add_remote_agent(desc.agent_metadata)
        return name.decode() if isinstance(name, bytes) else name

    def _drop_remote_agent(self, name: str) -> bool:
        try:
            self._agent.remove_remote_agent(name)
            return True
        except Exception as e:
            log.debug("nixl remove_remote_agent(%s) failed: %s", name, e)
            return False

    def _disconnect(self, conn: str) -> None:
        with self._lock:
            if self._agent is not None:
                self._drop_remote_agent(conn)

    def _read_runs(self, conn: str, desc: PeerDescriptor, runs: list[BlockRun], lease_id: str | None,
                   deadline: Deadline) -> None:
        assert self._pool is not None
        block_bytes = desc.block_bytes
        local = _descriptor_array(runs_to_regions(runs, self._pool.data_ptr(), block_bytes, "local"),
                                  self._device_id)
        remote = _descriptor_array(runs_to_regions(runs, desc.pool_addr, block_bytes, "remote"), desc.device_id)
        handle = None
        try:
            with self._lock:
                local_descs = self._agent.get_xfer_descs(local, self._mem_type)
                remote_descs = self._agent.get_xfer_descs(remote, desc.mem_type)
                handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, conn)
                state = self._agent.transfer(handle)
            self._wait(handle, state, deadline)
        except TransferError:
            raise
        except Exception as e:  # nixlRemoteDisconnectError, nixlNotFoundError, ...
            raise TransferError(f"{deadline.what} failed in NIXL ({type(e).__name__}: {e}); the peer died, "
                                "restarted or deregistered its pool: free the local blocks and fetch its "
                                "current descriptor") from e
        finally:
            if handle is not None:
                self._release(handle, deadline)

    def _wait(self, handle: Any, state: str, deadline: Deadline) -> None:
        spin_until = time.perf_counter() + _SPIN_S
        sleep_s = 20e-6
        while state == "PROC":
            deadline.check()
            if time.perf_counter() > spin_until:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 1.5, _MAX_SLEEP_S)
            with self._lock:
                state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransferError(f"{deadline.what} failed: NIXL reported {state}; the peer is likely gone. "
                                "Free the local blocks and fetch its current descriptor")

    def _release(self, handle: Any, deadline: Deadline) -> None:
        with self._lock:
            if self._agent is None:
                return
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as e:
                # NIXL could not cancel an active READ: the local blocks may still be written.
                log.error("nixl could not release the transfer of %s (%s); its local blocks must not be "
                          "reused until the peer is gone", deadline.what, e)

    def _notify(self, conn: str, desc: PeerDescriptor, notif_payload: bytes, deadline: Deadline) -> None:
        with self._lock:
            try:
                self._agent.send_notif(conn, notif_payload)
            except Exception as e:
                raise TransferError(f"notifying {desc.peer_id} failed ({type(e).__name__}: {e})") from e

    # ---- shutdown ---------------------------------------------------------

    def _close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        with self._lock:
            if self._reg_descs is not None:
                try:
                    self._agent.deregister_memory(self._reg_descs)
                except Exception as e:
                    log.info("nixl deregister_memory failed at close: %s", e)
            self._agent = None  # the native agent goes with its last reference


def _descriptor_array(regions: list[tuple[int, int]], device_id: int) -> np.ndarray:
    """NIXL's Nx3 (address, length, device id) descriptor list."""
    out = np.empty((len(regions), 3), dtype=np.uint64)
    for i, (addr, length) in enumerate(regions):
        out[i] = (addr, length, device_id)
    return out
