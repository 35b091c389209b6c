"""Both backends, owner and puller in one process, holding the cluster
secret as the serving layer's always do: byte identity, stats,
notifications, validation, handshakes and their refusals.  The same
scenarios across real processes live in tests/integration/transfer; what
the secret keeps out is in test_transfer_auth*.py."""

import random
import threading
import time

import pytest
import torch

from pdcluster.services.engine.lease import LeaseTable
from pdcluster.transfer import KVLayout, LayoutMismatchError, LeaseExpiredError, TransferError, create_backend
from pdcluster.transfer.peer import PeerDescriptor
from transfer_lease_fakes import BACKENDS, LAYOUT, make_pool, pair, same_bytes  # noqa: F401 (pair: fixture)
from transfer_raw_client import SECRET


def block_lists(rng, owner_blocks, puller_blocks):
    yield [5], [0]
    yield list(range(10, 42)), list(range(16, 48))
    yield rng.sample(range(owner_blocks), 20), rng.sample(range(puller_blocks), 20)
    runs = list(range(0, 8)) + [40] + list(range(50, 53))
    yield runs, list(range(30, 42))


def test_block_lists_arrive_byte_identical(pair):
    owner, puller, owner_pool, puller_pool = pair
    descriptor = owner.describe()
    for remote, local in block_lists(random.Random(0), 64, 48):
        stats = puller.pull(descriptor, remote, local)
        assert same_bytes(puller_pool[local], owner_pool[remote])
        assert stats.num_blocks == len(remote) and stats.num_bytes == len(remote) * LAYOUT.block_bytes
    assert puller.num_handshakes == 1  # metadata is fetched once per peer


def test_descriptor_counts_follow_coalescing(pair):
    owner, puller, _, _ = pair
    d = owner.descriptor()
    assert puller.pull(d, list(range(0, 32)), list(range(0, 32))).num_descriptors == 1
    assert puller.pull(d, [0, 1, 2, 10, 11], [5, 6, 7, 20, 22]).num_descriptors == 3


def test_notifications_carry_lease_ids_even_for_empty_pulls(pair):
    owner, puller, _, _ = pair
    d = owner.describe()
    puller.pull(d, [1, 2], [3, 4], notif="lease-a")
    puller.pull(d, [], [], notif="lease-b")  # decode side already had every block cached
    puller.pull(d, [3], [5])  # no lease: no notification
    got = wait_for_notifications(owner, 2)
    assert [(n.from_peer, n.lease_id) for n in got] == [("decode-0", "lease-a"), ("decode-0", "lease-b")]


def test_notification_releases_the_lease_and_expiry_frees_the_rest(pair):
    owner, puller, _, _ = pair
    free_blocks = set(range(64))
    leases = LeaseTable(free_blocks.update, default_ttl_s=30.0)
    for lease_id, blocks in [("pulled", [1, 2, 3]), ("abandoned", [7, 8])]:
        free_blocks.difference_update(blocks)
        leases.pin(lease_id, blocks, ttl_s=30.0 if lease_id == "pulled" else 0.2)
    assert len(free_blocks) == 59
    puller.pull(owner.describe(), [1, 2, 3], [0, 1, 2], notif="pulled")
    for n in wait_for_notifications(owner, 1):
        assert leases.release(n.lease_id)
    assert len(free_blocks) == 62
    assert leases.expire(now=leases.get("abandoned").expires_at + leases.expiry_grace_s) == ["abandoned"]
    assert len(free_blocks) == 64 and len(leases) == 0


def test_the_engines_lease_table_guards_socket_reads():
    free_blocks = set(range(64))
    leases = LeaseTable(free_blocks.update, default_ttl_s=30.0)
    with create_backend("fallback", peer_id="prefill-0", secret=SECRET) as owner, \
            create_backend("fallback", peer_id="decode-0", secret=SECRET, timeout_s=5.0) as puller:
        owner_pool, puller_pool = make_pool(64, 1), make_pool(8, 2)
        owner.register_pool(owner_pool, LAYOUT, lease_guard=leases)
        puller.register_pool(puller_pool, LAYOUT)
        free_blocks.difference_update([4, 5])
        lease = leases.pin("req-1", [4, 5])
        puller.pull(owner.describe(), [4, 5], [0, 1], notif="req-1", lease_deadline_unix=lease.deadline_unix)
        assert same_bytes(puller_pool[:2], owner_pool[4:6])
        for n in wait_for_notifications(owner, 1):
            assert leases.release(n.lease_id)
        assert len(free_blocks) == 64 and leases.num_pinned_blocks == 0
        with pytest.raises(LeaseExpiredError, match="unknown or already released lease"):
            puller.pull(owner.describe(), [4, 5], [0, 1], notif="req-1")


def test_bad_block_ids_are_caller_errors_and_move_nothing(pair):
    owner, puller, _, puller_pool = pair
    before = puller_pool.clone()
    with pytest.raises(ValueError, match="remote block id 64 is outside"):
        puller.pull(owner.describe(), [64], [0])
    with pytest.raises(ValueError, match="local block 1 appears twice"):
        puller.pull(owner.describe(), [0, 1], [1, 1])
    assert same_bytes(before, puller_pool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_mismatch_is_refused_naming_both_sides(backend):
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", block_size=4,
                     model_fingerprint=7)
    with create_backend(backend, peer_id="prefill-0", secret=SECRET) as owner, \
            create_backend(backend, peer_id="decode-0", secret=SECRET) as puller:
        owner.register_pool(make_pool(8, 1), LAYOUT)
        puller.register_pool(make_pool(8, 2, other), other)
        with pytest.raises(LayoutMismatchError, match="head_dim: 32 here vs 16 on prefill-0"):
            puller.pull(owner.describe(), [0], [0])


def test_a_descriptor_of_the_other_backend_is_refused():
    with create_backend("fallback", peer_id="prefill-0", secret=SECRET) as owner, \
            create_backend("nixl", peer_id="decode-0", secret=SECRET) as puller:
        owner.register_pool(make_pool(8, 1), LAYOUT)
        puller.register_pool(make_pool(8, 2), LAYOUT)
        with pytest.raises(TransferError, match="over the 'fallback' transfer backend but this side .* 'nixl'"):
            puller.pull(owner.describe(), [0], [0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_restarted_peer_is_rehandshaken_and_its_stale_descriptor_refused(backend):
    with create_backend(backend, peer_id="decode-0", secret=SECRET, timeout_s=2.0) as puller:
        puller_pool = make_pool(8, 0)
        puller.register_pool(puller_pool, LAYOUT)
        first = create_backend(backend, peer_id="prefill-0", secret=SECRET)
        first.register_pool(make_pool(8, 1), LAYOUT)
        stale = first.describe()
        puller.pull(stale, [0], [0])
        first.close()
        with create_backend(backend, peer_id="prefill-0", secret=SECRET) as second:
            second_pool = make_pool(8, 2)
            second.register_pool(second_pool, LAYOUT)
            fresh = PeerDescriptor.decode(second.describe())
            assert fresh.epoch != PeerDescriptor.decode(stale).epoch
            puller.pull(fresh, [3], [3])
            assert same_bytes(puller_pool[3], second_pool[3]) and puller.num_handshakes == 2
            with pytest.raises(TransferError):
                puller.pull(stale, [4], [4])


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_a_secret_nothing_is_signed_and_pulls_work_as_before(backend):
    with create_backend(backend, peer_id="prefill-0") as owner, \
            create_backend(backend, peer_id="decode-0", timeout_s=5.0) as puller:
        owner_pool, puller_pool = make_pool(16, 1), make_pool(16, 2)
        owner.register_pool(owner_pool, LAYOUT)
        puller.register_pool(puller_pool, LAYOUT)
        assert not owner.authenticated and owner.descriptor().signature == b""
        puller.pull(owner.describe(), [3, 4, 9], [0, 1, 2], notif="lease-a")
        assert same_bytes(puller_pool[:3], owner_pool[[3, 4, 9]])
        assert [n.lease_id for n in wait_for_notifications(owner, 1)] == ["lease-a"]


def test_lifecycle_misuse_is_reported():
    backend = create_backend("fallback", peer_id="x")
    with pytest.raises(RuntimeError, match="register_pool"):
        backend.describe()
    backend.register_pool(make_pool(4, 0), LAYOUT)
    with pytest.raises(RuntimeError, match="already serves a pool"):
        backend.register_pool(make_pool(4, 0), LAYOUT)
    descriptor = backend.describe()
    backend.close()
    with pytest.raises(TransferError, match="closed"):
        backend.pull(descriptor, [0], [0])


def wait_for_notifications(owner, count, timeout_s=5.0):
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += owner.poll_notifications()
        time.sleep(0.002)
    return got


def test_wait_notifications_wakes_on_arrival_not_at_its_timeout(pair):
    # A release notification ends the wait at once (the worker's lease loop sleeps in it).
    owner, puller, _, _ = pair
    threading.Timer(0.2, lambda: puller.pull(owner.describe(), [], [], notif="req-9")).start()
    started = time.monotonic()
    got = owner.wait_notifications(30.0)
    while not got and time.monotonic() - started < 30:   # a wake with nothing yet: wait again
        got = owner.wait_notifications(30.0)
    assert [n.lease_id for n in got] == ["req-9"] and time.monotonic() - started < 20  # not the 30 s timeout
    assert owner.wait_notifications(0.01) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peer_long_unused_is_forgotten_when_another_comes(backend):
    # Replicas come and go: what a puller keeps per owner (connection, NIXL remote agent, lock)
    # must not grow with every owner it ever pulled from.
    owners = [create_backend(backend, peer_id=f"prefill-{i}", secret=SECRET) for i in range(3)]
    puller = create_backend(backend, peer_id="decode-0", secret=SECRET)
    try:
        for i, owner in enumerate(owners):
            owner.register_pool(make_pool(8, i), LAYOUT)
        puller.register_pool(make_pool(8, 9), LAYOUT)
        puller.pull(owners[0].describe(), [1], [1])
        puller.peer_idle_s = 0.0          # from now on every other peer counts as long unused
        puller.pull(owners[1].describe(), [1], [2])
        assert set(puller._peers) == {"prefill-1"} and set(puller._peer_locks) == {"prefill-1"}
        if backend == "nixl":
            assert [a for a in puller._remote_agents if a.startswith("prefill-0")] == []
        puller.peer_idle_s = 600.0
        puller.pull(owners[0].describe(), [2], [3])   # it came back: a fresh handshake
        puller.pull(owners[2].describe(), [2], [4])
        assert set(puller._peers) == {"prefill-0", "prefill-1", "prefill-2"}
    finally:
        puller.close()
        for owner in owners:
            owner.close()
