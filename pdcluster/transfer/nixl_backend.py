"""NIXL backend: one READ per pull issued by the puller (one-sided), or, in
pull mode "write", one WRITE issued by the owner at the puller's request.

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
  not authenticated: see pdcluster.transfer.base for what that leaves open.

- Pull mode (pdcluster.transfer.pull_mode): over UCX's TCP transport a READ is emulated
  with active messages the owner's CPU answers fragment by fragment, while a
  WRITE is a zero-copy send; there the owner writes (pdcluster.transfer.nixl_writer,
  pdcluster.transfer.nixl_write_puller), and, seeing every pull, checks the lease as the
  socket fallback does.  On one host (cma) the puller READs: no round trip.

Remote descriptors are built from the peer descriptor's ``pool_addr`` rather
than NIXL's pickled descriptor lists: nothing from the wire is unpickled."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from pdcluster.transfer.base import TransferBackend
from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.errors import BackendUnavailableError, TransferError, TransferInDoubtError
from pdcluster.transfer.layout import KVLayout
from pdcluster.transfer.lease_guard import LeaseGuard
from pdcluster.transfer.nixl_write_puller import WriteMailbox, pull_by_write
from pdcluster.transfer.nixl_writer import NixlWriter
from pdcluster.transfer.peer import PeerDescriptor, peer_id_of_agent
from pdcluster.transfer.pull_mode import choose_pull_mode
from pdcluster.transfer.runs import BlockRun, descriptor_array, local_ids_of, runs_to_regions
from pdcluster.transfer.wire import unpack
from pdcluster.transfer.write_request import WriteDone, decode, is_write_message, max_message_bytes

log = logging.getLogger("pdcluster.transfer")

# Quiet: nothing lent, heard or written for _QUIET_AFTER_S.  The owner's tick then slows from
# progress_interval_s to _QUIET_TICK_S (an idle replica's ticker took 2% of a core at 5 ms; 2-core
# Sapphire Rapids).  Nothing waits on a quiet owner: a pull needs a lease, and the lease table
# wakes the ticker when it pins one (LeaseTable.add_pin_listener), so only a guard that tells of
# its pins lets the tick go quiet.
_QUIET_AFTER_S = 30.0
_QUIET_TICK_S = 0.25
_SPIN_S = 200e-6  # poll without sleeping this long: small pulls finish in ~50 us
_MAX_SLEEP_S = 1e-3
_BUSY_TICK_S = 100e-6  # while the owner writes: progress its worker often enough to keep the socket full
_BACKOFF = 0.05  # after a write, the idle tick is this fraction of the time since (a pull waits ~2.5% of the gap)


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
    one_sided = True  # READs on same-host CMA and RDMA; in pull mode "write" the owner's ticker moves the bytes
    device_memory = True
    needs_listener = False
    checks_lease_on_read = False  # READs: the puller's deadline checks stand in; a WRITE asks the guard

    def __init__(self, peer_id: str | None = None, timeout_s: float = 10.0, secret: bytes | None = None,
                 progress_interval_s: float | None = 0.005, ucx_error_handling: str = "none",
                 net_devices: str | None = None, pull_mode: str = "auto") -> None:
        """``net_devices``: UCX_NET_DEVICES for this process's agents (``lo``, or
        the device of the address peers reach this host on); None keeps the environment's.
        ``pull_mode``: "read", "write" or "auto" (pdcluster.transfer.pull_mode: the measured best for
        the transport UCX will use).  An owner serves write requests in every mode."""
        super().__init__(peer_id, timeout_s, secret)
        nixl_agent, nixl_agent_config = _load_nixl()
        if net_devices is not None:  # UCX reads it when the agent's context starts, just below
            os.environ["UCX_NET_DEVICES"] = net_devices
        self.pull_mode = choose_pull_mode(pull_mode, os.environ)
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
        self._wake = threading.Event()  # a write request arrived, or close()
        self._ticker: threading.Thread | None = None
        self._lease_guard: LeaseGuard | None = None
        self._may_go_quiet = False  # the guard wakes the ticker when it pins a lease
        self._last_activity = time.monotonic()  # a lease pinned, a notification heard, a write served
        self._remote_agents: set[str] = set()  # loaded in NIXL: owners pulled from, pullers written to
        # READs NIXL could not cancel: (handle, settled, number of local blocks), retried by _settle
        self._unsettled: list[tuple[Any, threading.Event, int]] = []
        self._writer = NixlWriter(self)
        self._mailbox = WriteMailbox()
        self._max_message_bytes = 0
        self._own_encoded: bytes | None = None
        self._reg_descs: Any = None
        self._mem_type = "DRAM"
        self._device_id = 0

    # ---- owner side -------------------------------------------------------

    def _register(self, kv_pool: torch.Tensor, layout: KVLayout, lease_guard: LeaseGuard | None) -> None:
        self._mem_type = "DRAM" if kv_pool.device.type == "cpu" else "VRAM"
        self._device_id = kv_pool.device.index or 0
        self._lease_guard = lease_guard  # asked by the writer: an owner that WRITEs sees every pull
        add_pin_listener = getattr(lease_guard, "add_pin_listener", None)
        if add_pin_listener is not None:
            add_pin_listener(self._lease_pinned)
            self._may_go_quiet = True
        self._max_message_bytes = max_message_bytes(kv_pool.shape[0])
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

    def _lease_pinned(self) -> None:
        """The lease table pinned a lease (on the pinning thread): a pull may follow."""
        self._last_activity = time.monotonic()
        self._wake.set()

    def _tick(self) -> None:
        """Every ``progress_interval_s`` when idle (``idle_tick_s``); every _BUSY_TICK_S while
        writing, backing off in proportion to the time since the last write (pulls come in bursts)."""
        last_busy = 0.0
        while not self._stop.is_set():
            try:
                self._collect_notifications()
                self._writer.service()
                self._settle()
            except Exception:  # a bug must not stop the owner's progress for good
                log.exception("kv nixl progress tick failed: peer=%s", self.peer_id)
            now = time.monotonic()
            if self._writer.busy:
                last_busy = self._last_activity = now
            idle = idle_tick_s(self._progress_interval_s, now - self._last_activity, self._may_go_quiet)
            self._wake.wait(min(max(_BUSY_TICK_S, (now - last_busy) * _BACKOFF), idle))
            self._wake.clear()

    def _collect_notifications(self) -> None:
        """Progresses the worker and routes what arrived: write requests and
        cancellations to the writer, answers to the mailbox, the rest (lease
        releases) to the inbox."""
        with self._lock:
            if self._agent is None:
                return
            try:
                fresh = self._agent.get_new_notifs()
            except Exception as e:
                log.warning("nixl notification poll failed: %s", e)
                return
        if fresh:
            self._last_activity = time.monotonic()
        for sender, payloads in fresh.items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            for payload in payloads:
                self._route(sender, bytes(payload))

    def _route(self, sender: str, payload: bytes) -> None:
        try:
            obj = unpack(payload, max(self._max_message_bytes, 4096), f"notification from {sender!r:.140}")
        except TransferError as e:
            self._reject_notification("ignoring a malformed transfer notification: %s", e)
            return
        if not is_write_message(obj):
            with self._lock:
                self._inbox.append((peer_id_of_agent(sender), payload))
            self._arrived.set()
            return
        if obj["op"] == "ping":
            return
        try:
            msg = decode(obj, sender)
        except TransferError as e:
            self._reject_notification("ignoring a malformed write-path notification: %s", e)
            return
        if isinstance(msg, WriteDone):
            self._mailbox.deliver(sender, msg)
        else:
            self._writer.submit(sender, msg)
            self._wake.set()

    def _raw_notifications(self) -> list[tuple[str, bytes]]:
        self._collect_notifications()
        self._writer.service()  # also serves writes where no ticker runs (progress_interval_s=None)
        self._settle()
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    # ---- puller side ------------------------------------------------------

    def _connect(self, desc: PeerDescriptor, deadline: Deadline) -> str:
        self._ensure_remote_agent(desc)
        return desc.agent_name

    def _ensure_remote_agent(self, desc: PeerDescriptor) -> None:
        """Loads and connects ``desc``'s agent unless it is (as an owner pulled
        from, or a puller written to: one copy per agent in NIXL)."""
        with self._lock:
            if self._agent is None:
                raise TransferError(f"{self.name} backend {self.peer_id} is closed; create a new one")
            if desc.agent_name in self._remote_agents:
                return
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
            self._remote_agents.add(name)

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
        self._remote_agents.discard(name)
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
        if self.pull_mode == "write":
            pull_by_write(self, desc, runs, lease_id, deadline)
            return
        block_bytes = desc.block_bytes
        local = descriptor_array(runs_to_regions(runs, self._pool.data_ptr(), block_bytes, "local"),
                                  self._device_id)
        remote = descriptor_array(runs_to_regions(runs, desc.pool_addr, block_bytes, "remote"), desc.device_id)
        handle, landed = None, False
        try:
            with self._lock:
                local_descs = self._agent.get_xfer_descs(local, self._mem_type)
                remote_descs = self._agent.get_xfer_descs(remote, desc.mem_type)
                handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, conn)
                state = self._agent.transfer(handle)
            self._wait(handle, state, deadline)
            landed = True
        except TransferError:
            raise
        except Exception as e:  # nixlRemoteDisconnectError, nixlNotFoundError, ...
            raise TransferError(f"{deadline.what} failed in NIXL ({type(e).__name__}: {e}); the peer died, "
                                "restarted or deregistered its pool: free the local blocks and fetch its "
                                "current descriptor") from e
        finally:
            if handle is not None and not self._release(handle, deadline.what) and not landed:
                # NIXL could not cancel the READ: it may still land.  Replaces the error in flight
                # (kept as the context): the caller must hold the blocks, not free them.
                raise self._in_doubt(handle, runs, deadline.what)

    def _in_doubt(self, handle: Any, runs: list[BlockRun], what: str) -> TransferInDoubtError:
        """Keeps ``handle`` to settle later (the ticker retries its release) and
        names the local blocks it may still write."""
        settled = threading.Event()
        local_ids = local_ids_of(runs)
        with self._lock:
            self._unsettled.append((handle, settled, len(local_ids)))
        return TransferInDoubtError(
            f"{what} failed and NIXL could not cancel its READ: its {len(local_ids)} local blocks may still be "
            "written; hold them out of reuse until the transfer settles", local_ids, settled.is_set)

    def _settle(self) -> None:
        """Retries the release of every READ that could not be cancelled: one that
        is no longer in progress and releases is settled (its blocks may be reused)."""
        with self._lock:
            if not self._unsettled or self._agent is None:
                return
            pending = []
            for handle, settled, num_blocks in self._unsettled:
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception as e:  # noqa: BLE001 - an ended transfer may report an error; release decides
                    state = f"ERR ({type(e).__name__})"
                if state == "PROC" or not self._try_release(handle):
                    pending.append((handle, settled, num_blocks))
                    continue
                settled.set()
                log.info("nixl transfer settled: %d local blocks may be reused", num_blocks)
            self._unsettled = pending

    @property
    def num_unsettled_blocks(self) -> int:
        """Local blocks a READ that could not be cancelled may still write."""
        with self._lock:
            return sum(n for _, _, n in self._unsettled)

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

    def _release(self, handle: Any, what: str) -> bool:
        """Releases (and so cancels) a transfer; False when NIXL refused, i.e. could not cancel it."""
        with self._lock:
            if self._agent is None:
                return True
            released = self._try_release(handle)
        if not released:
            log.error("nixl could not release the transfer of %s; its blocks are held until it settles", what)
        return released

    def _try_release(self, handle: Any) -> bool:
        """Under self._lock."""
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception as e:  # noqa: BLE001 - nixl's errors: an active transfer it cannot cancel
            log.debug("nixl release_xfer_handle failed: %s", e)
            return False

    def _notify(self, conn: str, desc: PeerDescriptor, notif_payload: bytes, deadline: Deadline) -> None:
        self._send(desc, notif_payload, deadline)

    def _send(self, desc: PeerDescriptor, payload: bytes, deadline: Deadline) -> None:
        with self._lock:
            if self._agent is None:
                raise TransferError(f"{self.name} backend {self.peer_id} is closed; create a new one")
            try:
                self._agent.send_notif(desc.agent_name, payload)
            except Exception as e:
                raise TransferError(f"{deadline.what}: sending to {desc.peer_id} failed "
                                    f"({type(e).__name__}: {e})") from e

    def _own_descriptor(self) -> bytes:
        """This side's signed descriptor, the write requests' ``puller`` (fixed for the epoch)."""
        if self._own_encoded is None:
            self._own_encoded = self.describe()
        return self._own_encoded

    # ---- shutdown ---------------------------------------------------------

    def _close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        self._writer.close()  # every write in flight released, its lease read ended
        with self._lock:
            if self._reg_descs is not None:
                try:
                    self._agent.deregister_memory(self._reg_descs)
                except Exception as e:
                    log.info("nixl deregister_memory failed at close: %s", e)
            self._agent = None  # the native agent goes with its last reference
            for _, settled, _ in self._unsettled:
                settled.set()  # the pool goes with this backend: nothing is reused after it
            self._unsettled = []


def idle_tick_s(progress_interval_s: float, since_activity_s: float, may_go_quiet: bool) -> float:
    """The owner's tick when it writes nothing (pure): ``progress_interval_s``, or _QUIET_TICK_S
    once quiet for _QUIET_AFTER_S where the lease guard wakes it on a pin."""
    if may_go_quiet and since_activity_s > _QUIET_AFTER_S:
        return max(progress_interval_s, _QUIET_TICK_S)
    return progress_interval_s
