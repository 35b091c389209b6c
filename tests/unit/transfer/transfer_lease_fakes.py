"""Shared by the lease tests: a LeaseGuard over a dict that records every
call, small pools with known bytes, and a wait helper for owner threads."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from transfer_raw_client import SECRET

from pdcluster.transfer import KVLayout, TransferBackend, create_backend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_size=4, model_fingerprint=7)
BACKENDS = ["nixl", "fallback"]
PULL_KINDS = ["nixl", "nixl-write", "fallback"]  # "nixl-write": the owner WRITEs at the puller's request


def pull_backend(kind: str, **options) -> TransferBackend:
    """A backend of ``kind`` (PULL_KINDS): NIXL pulls by READ or by the owner's WRITE."""
    if kind.startswith("nixl"):
        return create_backend("nixl", pull_mode="write" if kind == "nixl-write" else "read", **options)
    return create_backend(kind, **options)


class FakeLeases:
    """The LeaseGuard contract of the engine's LeaseTable, over a dict of
    lease id -> (block ids, unix deadline).  ``check_integrity`` asserts that
    every read the guard allowed has ended."""

    def __init__(self, begin_delay_s: float = 0.0) -> None:
        self.begin_delay_s = begin_delay_s  # an owner that stalls after allowing a read
        self.leases: dict[str, tuple[frozenset[int], float]] = {}
        self.calls: list[tuple] = []  # ("begin", lease, block ids, refusal) | ("end", lease)
        self.reading: Counter[str] = Counter()
        self._lock = threading.Lock()

    def lend(self, lease_id: str, block_ids: Sequence[int], ttl_s: float = 30.0) -> float:
        """Pins the blocks under ``lease_id``; returns its lease_deadline_unix."""
        deadline = time.time() + ttl_s
        self.leases[lease_id] = (frozenset(block_ids), deadline)
        return deadline

    def begin_read(self, lease_id: str, block_ids: Sequence[int]) -> str | None:
        with self._lock:
            lease = self.leases.get(lease_id)
            if lease is None:
                refusal = "unknown or released lease"
            elif time.time() >= lease[1]:
                refusal = "lease expired"
            elif not set(block_ids) <= lease[0]:
                refusal = f"blocks {sorted(set(block_ids) - lease[0])} are not in the lease"
            else:
                refusal = None
            self.calls.append(("begin", lease_id, tuple(block_ids), refusal))
            if refusal is None:
                self.reading[lease_id] += 1
        time.sleep(self.begin_delay_s)
        return refusal

    def end_read(self, lease_id: str) -> None:
        with self._lock:
            self.calls.append(("end", lease_id))
            self.reading[lease_id] -= 1

    def check_integrity(self, timeout_s: float = 10.0) -> None:
        """Every read begun has ended.  end_read runs on the owner's thread after
        the last byte left, which can be after the puller's pull returned: waits
        for it (up to ``timeout_s``) rather than racing it."""
        def all_ended() -> bool:
            with self._lock:
                return all(n == 0 for n in self.reading.values())
        assert wait_until(all_ended, timeout_s), f"reads begun but never ended: {self.reading}"


def make_pool(num_blocks: int, seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks * layout.block_bytes,), dtype=torch.uint8, generator=g)
    return raw.view(layout.torch_dtype).view(num_blocks, *layout.block_shape)


def owner_and_puller(kind: str, lease_guard=None):
    """(owner, puller, owner_pool, puller_pool) on one backend of ``kind``
    (PULL_KINDS), both holding the cluster secret: an owner of 64 blocks
    (behind ``lease_guard`` if given) and a puller of 48.  A fixture body:
    closes both after."""
    owner = pull_backend(kind, peer_id="prefill-0", secret=SECRET)
    puller = pull_backend(kind, peer_id="decode-0", secret=SECRET, timeout_s=5.0)
    owner_pool, puller_pool = make_pool(64, 1), make_pool(48, 2)
    owner.register_pool(owner_pool, LAYOUT, lease_guard=lease_guard)
    puller.register_pool(puller_pool, LAYOUT)
    yield owner, puller, owner_pool, puller_pool
    puller.close()
    owner.close()


def guarded_owner_and_puller(kind: str):
    """(leases, owner, puller, owner_pool, puller_pool): owner_and_puller with
    the owner behind a FakeLeases guard, whose integrity is checked after."""
    leases = FakeLeases()
    for backends in owner_and_puller(kind, lease_guard=leases):
        yield (leases, *backends)
    leases.check_integrity()


@pytest.fixture(params=PULL_KINDS)
def pair(request):
    yield from owner_and_puller(request.param)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def lease_ids_notified(owner, settle_s: float = 0.0, count: int | None = None, timeout_s: float = 5.0) -> list[str]:
    """Lease ids the owner heard of: waits for ``count`` of them, or ``settle_s`` when none are expected."""
    got: list[str] = []
    end = time.monotonic() + (timeout_s if count else settle_s)
    while time.monotonic() < end and (count is None or len(got) < count):
        got += [n.lease_id for n in owner.poll_notifications()]
        time.sleep(0.002)
    return got
