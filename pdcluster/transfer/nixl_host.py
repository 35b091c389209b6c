"""What the two halves of a NIXL write (``nixl_writer.py`` on the owner,
``nixl_write_puller.py`` on the puller) use of the backend that hosts them:
its agent and lock, pool and layout, lease table, secret and notification
channel.  A Protocol, so that they name the backend's shape without
importing the backend (which imports them)."""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.layout import KVLayout
from pdcluster.transfer.lease_guard import LeaseGuard
from pdcluster.transfer.peer import PeerDescriptor


class NixlHost(Protocol):
    name: str
    agent_name: str
    peer_id: str
    _agent: Any  # nixl_agent, used under _lock (NIXL_THREAD_SYNC_NONE)
    _lock: threading.Lock
    _pool: torch.Tensor | None
    _layout: KVLayout | None
    _mem_type: str
    _device_id: int
    _lease_guard: LeaseGuard | None
    _secret: bytes | None
    _mailbox: Any  # nixl_write_puller.WriteMailbox

    def _peer_descriptor(self, peer: PeerDescriptor | bytes) -> PeerDescriptor: ...
    def _reject_notification(self, message: str, *args: Any) -> None: ...
    def _ensure_remote_agent(self, desc: PeerDescriptor) -> None: ...
    def _disconnect(self, conn: str) -> None: ...
    def _release(self, handle: Any, what: str) -> None: ...
    def _send(self, desc: PeerDescriptor, payload: bytes, deadline: Deadline) -> None: ...
    def _collect_notifications(self) -> None: ...
    def _own_descriptor(self) -> bytes: ...
