"""The block server's limits: a connection cap that idle connections cannot
push past (no thread beyond it), idle and handshake timeouts, and a frame
limit sized to the pool and checked before a byte of the frame is kept."""

import logging
import socket
import struct
import threading
import time
import tracemalloc
import uuid

import pytest
from transfer_lease_fakes import LAYOUT, make_pool, same_bytes, wait_until
from transfer_raw_client import SECRET, open_session, read_raw_frame, read_until_closed

from pdcluster.transfer import TransferError, create_backend
from pdcluster.transfer.block_server import MAX_CONNECTIONS, ServerLimits, max_request_bytes
from pdcluster.transfer.peer import MAX_LEASE_ID_CHARS
from pdcluster.transfer.wire import pack


def owner_and_puller(limits: ServerLimits, owner_blocks: int = 64, puller_blocks: int = 64,
                     owner_id: str = "prefill-0"):
    owner = create_backend("fallback", peer_id=owner_id, secret=SECRET, limits=limits)
    puller = create_backend("fallback", peer_id="decode-0", secret=SECRET, timeout_s=5.0)
    owner_pool, puller_pool = make_pool(owner_blocks, 1), make_pool(puller_blocks, 2)
    owner.register_pool(owner_pool, LAYOUT)
    puller.register_pool(puller_pool, LAYOUT)
    return owner, puller, owner_pool, puller_pool


def connection_threads(owner_id: str) -> int:
    """Live serving threads of the block server of ``owner_id`` (its threads carry the name)."""
    return sum(t.name == f"kv-block-conn-{owner_id}" for t in threading.enumerate())


def test_a_thousand_idle_connections_hold_at_most_the_cap_and_pulls_go_on():
    # An owner id of its own: a serving thread of an earlier test's server (the same xdist worker runs
    # other files first, and they name their owner prefill-0) could still be ending while this one counts.
    owner_id = f"prefill-limits-{uuid.uuid4().hex[:8]}"
    owner, puller, owner_pool, puller_pool = owner_and_puller(ServerLimits(handshake_timeout_s=30.0),
                                                              owner_id=owner_id)
    server, address = owner.server, owner.descriptor().endpoint.rsplit(":", 1)
    with owner, puller:
        descriptor = owner.describe()
        puller.pull(descriptor, [1], [1])  # holds one authenticated connection
        idle = []
        try:
            for _ in range(1000):
                idle.append(socket.create_connection((address[0], int(address[1]))))
            assert wait_until(lambda: server.num_refused_connections == 1000 - (MAX_CONNECTIONS - 1))
            # Until a connection thread that let go of its socket has also exited (for a moment it
            # still runs beside the thread of the connection admitted in its place: 65 threads, once).
            assert wait_until(lambda: server.num_connections == MAX_CONNECTIONS == connection_threads(owner_id)), \
                (server.num_connections, connection_threads(owner_id))
            puller.pull(descriptor, [7, 8], [7, 8])  # its connection still serves
            assert same_bytes(puller_pool[[7, 8]], owner_pool[[7, 8]])
            with create_backend("fallback", peer_id="decode-1", secret=SECRET, timeout_s=2.0) as late:
                late.register_pool(make_pool(4, 3), LAYOUT)
                with pytest.raises(TransferError, match="closed the connection unasked: it is at its connection cap"):
                    late.pull(descriptor, [0], [0])
        finally:
            for sock in idle:
                sock.close()
        assert wait_until(lambda: server.num_connections == 1 == connection_threads(owner_id))
        with create_backend("fallback", peer_id="decode-1", secret=SECRET, timeout_s=2.0) as late:
            late_pool = make_pool(4, 3)
            late.register_pool(late_pool, LAYOUT)
            late.pull(descriptor, [9], [0])
            assert same_bytes(late_pool[0], owner_pool[9])
        assert server.num_failed_authentications == 0  # the idle ones were closed for silence, not refused


def test_an_idle_authenticated_connection_is_closed_after_the_idle_timeout_and_the_puller_reconnects():
    owner, puller, owner_pool, puller_pool = owner_and_puller(ServerLimits(idle_timeout_s=0.5))
    with owner, puller:
        descriptor = owner.describe()
        puller.pull(descriptor, [1], [1])
        opened = time.monotonic()
        assert owner.server.num_connections == 1
        assert wait_until(lambda: owner.server.num_connections == 0, timeout_s=30.0)  # a hang guard
        assert time.monotonic() - opened >= 0.45  # not before the idle timeout
        puller.pull(descriptor, [2], [2])  # a new connection, no new handshake with the peer
        assert same_bytes(puller_pool[2], owner_pool[2]) and puller.num_handshakes == 1
        sock = open_session(owner.descriptor(), SECRET, LAYOUT)
        with sock:
            t0 = time.monotonic()
            assert read_until_closed(sock, timeout_s=30.0) == b""  # closed (30 s: a hang guard)
            assert time.monotonic() - t0 >= 0.45  # not before the idle timeout


def test_a_client_that_never_answers_the_challenge_is_closed_after_the_handshake_timeout():
    owner, puller, _, _ = owner_and_puller(ServerLimits(handshake_timeout_s=0.3))
    with owner, puller:
        host, port = owner.descriptor().endpoint.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            t0 = time.monotonic()
            challenge = read_raw_frame(sock)
            assert read_until_closed(sock, timeout_s=30.0) == b""  # nothing after the challenge; 30 s: a hang guard
            assert time.monotonic() - t0 >= 0.25  # not before the handshake timeout
        assert b"nonce" in challenge and owner.server.num_connections == 0


@pytest.mark.parametrize("announced", ["limit + 1", "1 GiB"])
def test_a_request_frame_over_the_limit_closes_the_connection_unread(announced, caplog):
    caplog.set_level(logging.INFO, logger="pdcluster.transfer")
    owner, puller, _, _ = owner_and_puller(ServerLimits())
    with owner, puller:
        limit = owner.server.max_request_bytes
        assert limit == max_request_bytes(64) == 6144
        sock = open_session(owner.descriptor(), SECRET, LAYOUT)
        with sock:
            length = limit + 1 if announced == "limit + 1" else 1 << 30
            tracemalloc.start()
            try:
                sock.sendall(struct.pack(">I", length))  # no body follows: the server must not wait for one
                assert read_until_closed(sock, timeout_s=2.0) == b""
                peak_bytes = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        assert peak_bytes < 1 << 20
        assert wait_until(lambda: owner.server.num_connections == 0)
        assert f"announces {length} bytes, over the {limit}-byte frame limit" in caplog.text
        puller.pull(owner.describe(), [3], [3])  # the server itself is fine


def test_an_unauthenticated_frame_over_the_handshake_limit_is_closed_unread():
    owner, puller, _, _ = owner_and_puller(ServerLimits())
    with owner, puller:
        host, port = owner.descriptor().endpoint.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            read_raw_frame(sock)
            sock.sendall(struct.pack(">I", 1 << 31))
            assert read_until_closed(sock, timeout_s=2.0) == b""  # not even a refusal
        assert owner.server.num_failed_authentications == 0


def test_the_largest_legal_reads_fit_the_limit():
    """One run per block of the pool is the most a read names; a pull naming
    remote blocks twice (more runs than that) is split into several reads."""
    owner, puller, owner_pool, puller_pool = owner_and_puller(ServerLimits(), puller_blocks=160)
    with owner, puller:
        descriptor = owner.describe()
        backwards = list(range(63, -1, -1))
        stats = puller.pull(descriptor, backwards, list(range(64)), notif="lease-with-a-long-id-" + "x" * 230)
        assert stats.num_descriptors == 64 and same_bytes(puller_pool[:64], owner_pool[backwards])
        twice = backwards + backwards + [5]
        stats = puller.pull(descriptor, twice, list(range(len(twice))))
        assert stats.num_descriptors == 129 and same_bytes(puller_pool[:129], owner_pool[twice])


@pytest.mark.parametrize("num_blocks", [1, 64, 127, 128, 255, 256, 4096, 65535, 65536, 100_000])
def test_the_request_limit_bounds_a_read_of_one_run_per_block(num_blocks):
    longest_lease = "\U0001F600" * MAX_LEASE_ID_CHARS  # 4 bytes a char in UTF-8
    worst_read = pack({"op": "read", "runs": [[num_blocks, num_blocks]] * num_blocks, "lease": longest_lease})
    worst_notify = pack({"op": "notify", "payload": b"x" * 4096})
    limit = max_request_bytes(num_blocks)
    assert max(len(worst_read), len(worst_notify)) <= limit < max(len(worst_read), len(worst_notify)) + 2048
    if num_blocks <= 4096:
        assert limit <= 32 * 1024  # kilobytes, where one frame used to be allowed 8 MiB


def test_limits_are_checked():
    for bad in [dict(max_connections=0), dict(idle_timeout_s=0), dict(handshake_timeout_s=-1),
                dict(send_timeout_s=0.0), dict(max_connections=1.5)]:
        with pytest.raises(ValueError):
            ServerLimits(**bad)
