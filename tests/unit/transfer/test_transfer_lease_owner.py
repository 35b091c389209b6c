"""The owner's lease check on the socket fallback: a guarded owner serves a
read only under a live lease covering every block, keeps the blocks pinned
for exactly as long as it streams them, and refuses everything else before a
byte moves.  NIXL's owner cannot check (one-sided reads): it never asks."""

import logging
import socket
import struct
import time

import pytest
from transfer_lease_fakes import LAYOUT, FakeLeases, guarded_owner_and_puller, lease_ids_notified, make_pool, same_bytes, wait_until
from transfer_raw_client import SECRET, open_session

from pdcluster.transfer import LeaseExpiredError, TransferError, backend_class, create_backend
from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.peer import PeerDescriptor
from pdcluster.transfer.wire import MAX_REPLY_BYTES, recv_exactly, recv_frame, send_frame


@pytest.fixture
def guarded():
    """A fallback owner of 64 blocks behind a FakeLeases guard, and a puller of 48."""
    yield from guarded_owner_and_puller("fallback")


def test_only_the_socket_owner_checks_leases_on_read():
    assert backend_class("fallback").checks_lease_on_read is True
    assert backend_class("nixl").checks_lease_on_read is False


def test_a_read_within_its_lease_is_served_then_ended_then_released(guarded):
    leases, owner, puller, owner_pool, puller_pool = guarded
    deadline = leases.lend("req-1", [5, 6, 7, 20])
    puller.pull(owner.describe(), [5, 6, 7, 20], [0, 1, 2, 9], notif="req-1", lease_deadline_unix=deadline)
    assert same_bytes(puller_pool[[0, 1, 2, 9]], owner_pool[[5, 6, 7, 20]])
    assert wait_until(lambda: len(leases.calls) == 2)  # end_read runs on the owner's thread
    assert leases.calls == [("begin", "req-1", (5, 6, 7, 20), None), ("end", "req-1")]
    assert lease_ids_notified(owner, count=1) == ["req-1"]


@pytest.mark.parametrize("case", ["expired", "unknown", "released", "blocks outside it"])
def test_a_read_outside_a_live_lease_is_refused_and_lands_nothing(guarded, case):
    leases, owner, puller, owner_pool, puller_pool = guarded
    if case != "unknown":
        leases.lend("req-1", [5, 6], ttl_s=-1.0 if case == "expired" else 30.0)
    if case == "released":
        del leases.leases["req-1"]
    remote = [5, 6, 7] if case == "blocks outside it" else [5, 6]
    before = puller_pool.clone()
    with pytest.raises(LeaseExpiredError, match=r"lease 'req-1' from prefill-0 expired .*prefill the request again"):
        puller.pull(owner.describe(), remote, list(range(len(remote))), notif="req-1")
    assert same_bytes(puller_pool, before)
    assert [c[0] for c in leases.calls] == ["begin"]  # refused: no read to end
    assert lease_ids_notified(owner, settle_s=0.1) == []  # a refused pull releases nothing
    leases.lend("req-2", [9])
    puller.pull(owner.describe(), [9], [0], notif="req-2")  # the refusal left the connection usable
    assert same_bytes(puller_pool[0], owner_pool[9]) and puller.num_handshakes == 1


def test_the_refusal_says_why(guarded):
    leases, owner, puller, _, _ = guarded
    leases.lend("req-1", [5])
    with pytest.raises(LeaseExpiredError, match=r"blocks \[6\] are not in the lease"):
        puller.pull(owner.describe(), [5, 6], [0, 1], notif="req-1")


def test_a_read_naming_no_lease_is_refused_as_a_caller_error(guarded):
    _, owner, puller, _, _ = guarded
    with pytest.raises(TransferError, match="serves reads only under a lease: pass .* notif=lease_id") as e:
        puller.pull(owner.describe(), [5], [0])
    assert not isinstance(e.value, LeaseExpiredError)  # a new prefill would not help


def test_an_owner_stalling_past_the_lease_fails_the_pull_and_still_ends_its_read():
    leases = FakeLeases(begin_delay_s=0.5)
    with create_backend("fallback", peer_id="prefill-0", secret=SECRET) as owner, \
            create_backend("fallback", peer_id="decode-0", secret=SECRET, timeout_s=120.0) as puller:
        owner.register_pool(make_pool(16, 1), LAYOUT, lease_guard=leases)
        puller.register_pool(make_pool(16, 2), LAYOUT)
        deadline = leases.lend("req-1", [3], ttl_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(LeaseExpiredError, match="did not finish in the lease's time"):
            puller.pull(owner.describe(), [3], [0], notif="req-1", lease_deadline_unix=deadline)
        assert time.monotonic() - t0 < 60  # bounded by the 0.3 s lease, not by the 120 s timeout (a hang guard)
        assert wait_until(lambda: ("end", "req-1") in leases.calls)
        leases.check_integrity()


def test_end_read_runs_when_the_puller_dies_mid_stream(caplog):
    """A raw client that asks for 16 MiB, takes a few bytes and vanishes: the
    owner's send fails part-way, and the lease's read must still end."""
    caplog.set_level(logging.INFO, logger="pdcluster.transfer")
    leases = FakeLeases()
    num_blocks = (16 << 20) // LAYOUT.block_bytes  # more than the socket buffers of both ends hold
    with create_backend("fallback", peer_id="prefill-0", secret=SECRET) as owner:
        owner.register_pool(make_pool(num_blocks, 1), LAYOUT, lease_guard=leases)
        desc = PeerDescriptor.decode(owner.describe())
        leases.lend("req-1", range(num_blocks))
        deadline = Deadline(5.0, "test client")
        sock = open_session(desc, SECRET, LAYOUT, rcvbuf=4096)  # a small buffer keeps the owner in sendall
        send_frame(sock, {"op": "read", "runs": [[0, num_blocks]], "lease": "req-1"}, deadline)
        assert recv_frame(sock, deadline, "read reply", max_bytes=MAX_REPLY_BYTES) == \
            {"ok": True, "num_bytes": num_blocks * LAYOUT.block_bytes}
        recv_exactly(sock, memoryview(bytearray(1024)), deadline, "first bytes")
        assert leases.calls[-1] == ("begin", "req-1", tuple(range(num_blocks)), None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        sock.close()
        assert wait_until(lambda: ("end", "req-1") in leases.calls), "the read never ended: blocks stay pinned"
        leases.check_integrity()
    # the stream failed part-way, not finished (logged by the server thread just after the lease ends)
    assert wait_until(lambda: "dropped a connection" in caplog.text), caplog.text


def test_a_nixl_owner_accepts_a_guard_and_never_asks_it():
    leases = FakeLeases()
    with create_backend("nixl", peer_id="prefill-0", secret=SECRET) as owner, \
            create_backend("nixl", peer_id="decode-0", secret=SECRET, timeout_s=5.0) as puller:
        owner.register_pool(make_pool(16, 1), LAYOUT, lease_guard=leases)
        puller.register_pool(make_pool(16, 2), LAYOUT)
        puller.pull(owner.describe(), [3], [0], notif="req-1", lease_deadline_unix=time.time() + 30)
        assert lease_ids_notified(owner, count=1) == ["req-1"]
    assert leases.calls == []
