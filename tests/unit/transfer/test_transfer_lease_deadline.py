"""The puller's lease checks, on every backend (they alone protect NIXL's
one-sided reads): no read starts within the safety margin of the deadline, a
read is bounded by the lease, bytes that land after it are refused, and a pull
refused so sends no notification.  release() is the notify-only call."""

import time

import pytest
from transfer_lease_fakes import LAYOUT, lease_ids_notified, make_pool, pair, same_bytes  # noqa: F401 (pair: fixture)
from transfer_raw_client import SECRET

from pdcluster.transfer import LEASE_SAFETY_MARGIN_S, LeaseExpiredError, TransferError, create_backend
from pdcluster.transfer.lease_guard import LeaseClock


def test_the_lease_clamps_the_timeout_only_when_it_ends_sooner():
    far = LeaseClock(time.time() + 10.0, "req-1", "prefill-0")
    assert far.clamp_timeout_s(5.0) == 5.0 and not far.bounds_timeout
    assert 9.5 < far.clamp_timeout_s(20.0) <= 10.0 - LEASE_SAFETY_MARGIN_S and far.bounds_timeout
    assert LeaseClock(None, None, "prefill-0").clamp_timeout_s(5.0) == 5.0


@pytest.mark.parametrize("left_s", [-1.0, 0.0, LEASE_SAFETY_MARGIN_S / 2], ids=["passed", "now", "within-margin"])
def test_a_pull_too_close_to_the_deadline_never_touches_the_network(pair, left_s):
    owner, puller, _, puller_pool = pair
    before = puller_pool.clone()
    with pytest.raises(LeaseExpiredError, match=r"lease 'req-1' from prefill-0 expired .*prefill the request again"):
        puller.pull(owner.describe(), [5, 6], [0, 1], notif="req-1", lease_deadline_unix=time.time() + left_s)
    assert puller.num_handshakes == 0 and same_bytes(puller_pool, before)
    assert lease_ids_notified(owner, settle_s=0.1) == []


def test_a_pull_well_inside_the_lease_lands_and_notifies(pair):
    owner, puller, owner_pool, puller_pool = pair
    puller.pull(owner.describe(), [5, 6], [0, 1], notif="req-1", lease_deadline_unix=time.time() + 30)
    assert same_bytes(puller_pool[:2], owner_pool[5:7])
    assert lease_ids_notified(owner, count=1) == ["req-1"]


def test_a_stalled_read_is_cut_at_the_lease_not_at_the_timeout(pair, monkeypatch):
    owner, puller, _, _ = pair

    def stalled(conn, desc, runs, lease_id, deadline):  # a transport that honours the deadline but never finishes
        while True:
            deadline.check()
            time.sleep(0.005)

    monkeypatch.setattr(puller, "_read_runs", stalled)
    monkeypatch.setattr(puller, "timeout_s", 120.0)
    t0 = time.monotonic()
    with pytest.raises(LeaseExpiredError, match="did not finish in the lease's time"):
        puller.pull(owner.describe(), [5], [0], notif="req-1", lease_deadline_unix=time.time() + 0.3)
    # Cut at the lease (0.3 s - 0.25 s margin), not at the 120 s timeout: the bound
    # tells the two apart on any machine, however loaded.
    assert time.monotonic() - t0 < 60
    assert lease_ids_notified(owner, settle_s=0.1) == []


def test_bytes_that_land_after_the_deadline_are_refused_and_release_nothing(pair, monkeypatch):
    """NIXL's same-host READ copies inside one uninterruptible call: it can
    finish past the deadline, when the owner may already have recycled the blocks."""
    owner, puller, owner_pool, puller_pool = pair
    puller.pull(owner.describe(), [1], [1])  # handshake first: only the read itself runs late
    read_runs = puller._read_runs
    lease_deadline_unix = time.time() + 0.6

    def slow(*args):
        read_runs(*args)
        time.sleep(max(0.0, lease_deadline_unix - time.time()) + 0.02)

    monkeypatch.setattr(puller, "_read_runs", slow)
    with pytest.raises(LeaseExpiredError, match=r"the bytes landed 0\.\d+ s after the lease's deadline"):
        puller.pull(owner.describe(), [5], [0], notif="req-1", lease_deadline_unix=lease_deadline_unix)
    assert lease_ids_notified(owner, settle_s=0.2) == []  # a late release could free a new lease of that id
    monkeypatch.undo()
    puller.pull(owner.describe(), [7], [1], notif="req-2")  # the connection survived the refusal
    assert same_bytes(puller_pool[1], owner_pool[7]) and puller.num_handshakes == 1
    assert lease_ids_notified(owner, count=1) == ["req-2"]


def test_a_notify_only_pull_ignores_an_expired_deadline(pair):
    owner, puller, _, _ = pair  # nothing is read, so nothing can be stale: the owner may free the lease
    stats = puller.pull(owner.describe(), [], [], notif="req-1", lease_deadline_unix=time.time() - 5)
    assert stats.num_blocks == 0
    assert lease_ids_notified(owner, count=1) == ["req-1"]


def test_release_tells_the_owner_to_drop_the_lease(pair):
    owner, puller, _, _ = pair
    puller.release(owner.describe(), "req-1")
    puller.release(owner.descriptor(), "req-2", timeout_s=1.0)
    assert lease_ids_notified(owner, count=2) == ["req-1", "req-2"]
    with pytest.raises(ValueError, match="lease_id must be a non-empty str"):
        puller.release(owner.describe(), "")


def test_release_to_a_closed_socket_owner_raises_a_transfer_error():
    """Unacknowledged on both backends; the socket at least notices a closed owner
    (an in-process NIXL owner's UCX worker outlives close(), so it cannot here)."""
    with create_backend("fallback", peer_id="prefill-0", secret=SECRET) as owner, \
            create_backend("fallback", peer_id="decode-0", secret=SECRET, timeout_s=1.0) as puller:
        owner.register_pool(make_pool(8, 1), LAYOUT)
        puller.register_pool(make_pool(8, 2), LAYOUT)
        descriptor = owner.describe()
        puller.pull(descriptor, [1], [1])
        owner.close()
        with pytest.raises(TransferError) as e:
            for _ in range(3):  # the first send may still fit the dead connection's buffer
                puller.release(descriptor, "req-1")
        assert not isinstance(e.value, LeaseExpiredError)
