"""What the cluster secret keeps out: a client without it learns nothing of
the pool and moves no block, an owner without it is not pulled from, a
forged descriptor is refused before it is used, and a release notification
without a valid tag frees nothing.  The secret itself is never shown."""

import logging
import pickle
import struct
import time
from dataclasses import replace

import pytest
from transfer_lease_fakes import BACKENDS, LAYOUT, make_pool, same_bytes, wait_until
from transfer_raw_client import OTHER_SECRET, SECRET, authenticate, connect, read_raw_frame, read_until_closed

from pdcluster.services.engine.lease import LeaseTable
from pdcluster.transfer import AuthenticationError, PeerDescriptor, TransferError, create_backend
from pdcluster.transfer.auth import DESCRIPTOR, LEASE_RELEASE, PULLER_PROOF, ClusterSecret, new_nonce
from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.peer import encode_notification
from pdcluster.transfer.socket_auth import AUTH_REFUSAL
from pdcluster.transfer.wire import pack, send_frame, unpack


@pytest.fixture
def owner():
    with create_backend("fallback", peer_id="prefill-0", secret=SECRET) as owner:
        owner.register_pool(make_pool(64, 1), LAYOUT)
        yield owner


def frames(data: bytes) -> list[bytes]:
    out = []
    while data:
        (length,) = struct.unpack(">I", data[:4])
        out.append(data[4:4 + length])
        data = data[4 + length:]
    return out


def pool_giveaways(owner) -> list[bytes]:
    """Byte strings whose presence would tell a client about the pool."""
    return [pack(owner.epoch), f"{owner.epoch:x}".encode(), b"epoch", b"layout", b"num_layers", b"head_dim",
            b"bfloat16", b"model_fingerprint", b"num_blocks", b"idle_timeout_s", b"stale", b"prefill-0"]


WRONG_FIRST_FRAMES = {  # what a client without the secret might send, given the owner's challenge nonce
    "hello first": lambda nonce: {"op": "hello", "peer_id": "decode-9", "epoch": 1, "layout": LAYOUT.to_dict()},
    "read first": lambda nonce: {"op": "read", "runs": [[0, 64]]},
    "auth without mac": lambda nonce: {"op": "auth", "peer_id": "decode-9", "nonce": new_nonce()},
    "auth with another secret's mac": lambda nonce: {
        "op": "auth", "peer_id": "decode-9", "nonce": (cn := new_nonce()),
        "mac": ClusterSecret(OTHER_SECRET).mac(PULLER_PROOF, nonce, cn, "decode-9", "prefill-0")},
    "auth replaying a mac of another challenge": lambda nonce: {
        "op": "auth", "peer_id": "decode-9", "nonce": (cn := new_nonce()),
        "mac": ClusterSecret(SECRET).mac(PULLER_PROOF, new_nonce(), cn, "decode-9", "prefill-0")},
}


@pytest.mark.parametrize("case", WRONG_FIRST_FRAMES)
def test_a_client_without_the_secret_gets_one_fixed_refusal_and_nothing_else(owner, case, caplog):
    caplog.set_level(logging.DEBUG, logger="pdcluster.transfer")
    sock = connect(owner.descriptor())
    with sock:
        challenge = read_raw_frame(sock)
        assert set(unpack(challenge[4:], 100, "challenge")) == {"op", "nonce"}
        nonce = unpack(challenge[4:], 100, "challenge")["nonce"]
        send_frame(sock, WRONG_FIRST_FRAMES[case](nonce), Deadline(1.0, "test"))
        rest = read_until_closed(sock)
    assert frames(rest) == [pack(AUTH_REFUSAL)]  # the same bytes whatever was wrong, then closed
    assert [g for g in pool_giveaways(owner) if g in challenge + rest] == []
    assert owner.server.num_failed_authentications == 1
    assert "refused a puller that failed authentication" in caplog.text
    assert SECRET.hex() not in caplog.text and SECRET.decode() not in caplog.text


@pytest.mark.parametrize("their_secret", [None, OTHER_SECRET], ids=["no secret", "another secret"])
def test_a_backend_without_the_secret_moves_no_block_and_learns_no_epoch(owner, their_secret, caplog):
    genuine = owner.descriptor()
    # It can know the endpoint, not the epoch: it forges a descriptor (signed with its own secret, if any).
    forged = PeerDescriptor(backend="fallback", peer_id="prefill-0", epoch=1, layout=LAYOUT, num_blocks=64,
                            endpoint=genuine.endpoint)
    if their_secret is not None:
        forged = forged.signed(ClusterSecret(their_secret).mac(DESCRIPTOR, forged.body()))
    with create_backend("fallback", peer_id="decode-6", secret=their_secret, timeout_s=2.0) as intruder:
        pool = make_pool(8, 2)
        before = pool.clone()
        intruder.register_pool(pool, LAYOUT)
        hint = "no cluster secret" if their_secret is None else "hold different cluster secrets"
        with pytest.raises(AuthenticationError, match=f"prefill-0 refused this side's authentication; .*{hint}") as e:
            intruder.pull(forged, [0, 1], [0, 1])
        assert f"{owner.epoch:x}" not in str(e.value) and "num_layers" not in str(e.value)
        with pytest.raises(AuthenticationError):
            intruder.release(forged, "req-1")
        assert same_bytes(pool, before)
    assert owner.server.num_failed_authentications == 2
    assert caplog.text.count("refused a puller that failed authentication") == 1  # then quiet for a while
    assert owner.poll_notifications() == []


@pytest.mark.parametrize("impostor_secret", [None, OTHER_SECRET], ids=["no secret", "another secret"])
def test_a_puller_does_not_pull_from_an_owner_that_cannot_prove_the_secret(impostor_secret):
    """The owner died and something else took its port: its genuine descriptor leads to an impostor."""
    with create_backend("fallback", peer_id="prefill-0", secret=SECRET) as genuine:
        genuine.register_pool(make_pool(16, 1), LAYOUT)
        descriptor = genuine.describe()
        port = int(genuine.descriptor().endpoint.rsplit(":", 1)[1])
    with create_backend("fallback", peer_id="prefill-0", secret=impostor_secret, port=port) as impostor, \
            create_backend("fallback", peer_id="decode-0", secret=SECRET, timeout_s=2.0) as puller:
        impostor.register_pool(make_pool(16, 3), LAYOUT)
        pool = make_pool(16, 2)
        before = pool.clone()
        puller.register_pool(pool, LAYOUT)
        expected = "did not prove it is prefill-0" if impostor_secret is None else "refused this side's"
        with pytest.raises(AuthenticationError, match=expected):
            puller.pull(descriptor, [0], [0])
        assert same_bytes(pool, before)


FORGERIES = {
    "unsigned": lambda d: replace(d, signature=b""),
    "signed with another secret": lambda d: d.signed(ClusterSecret(OTHER_SECRET).mac(DESCRIPTOR, d.body())),
    "another agent or endpoint": lambda d: replace(d, agent_metadata=b"attacker's agent", endpoint="127.0.0.1:9"),
    "another address": lambda d: replace(d, pool_addr=d.pool_addr + 4096),
}


@pytest.mark.parametrize("forgery", FORGERIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_descriptor_without_a_valid_signature_is_refused_before_connecting(backend, forgery):
    with create_backend(backend, peer_id="prefill-0", secret=SECRET) as owner, \
            create_backend(backend, peer_id="decode-0", secret=SECRET, timeout_s=2.0) as puller:
        owner_pool, pool = make_pool(16, 1), make_pool(16, 2)
        owner.register_pool(owner_pool, LAYOUT)
        puller.register_pool(pool, LAYOUT)
        connects = []
        hook = "_add_remote_agent" if backend == "nixl" else "_connect"
        real = getattr(puller, hook)
        setattr(puller, hook, lambda *args: connects.append(args) or real(*args))
        forged = FORGERIES[forgery](owner.descriptor())
        state = "is not signed" if forgery == "unsigned" else "carries a wrong signature"
        for as_sent in (forged, forged.encode()):
            with pytest.raises(AuthenticationError, match=f"descriptor of peer prefill-0 {state}"):
                puller.pull(as_sent, [0], [0])
            with pytest.raises(AuthenticationError):
                puller.release(as_sent, "req-1")
        assert connects == [] and puller.num_handshakes == 0
        puller.pull(owner.describe(), [5], [0])  # the genuine one, signed by describe()
        assert len(connects) == 1 and same_bytes(pool[0], owner_pool[5])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_release_from_outside_the_cluster_frees_nothing(backend, caplog):
    """NIXL delivers a stranger's notification (anyone reaching the agent can
    send one); the owner drops it for its tag.  The socket owner never lets
    the stranger in."""
    free_blocks = set(range(16))
    leases = LeaseTable(free_blocks.update, default_ttl_s=30.0)
    with create_backend(backend, peer_id="prefill-0", secret=SECRET) as owner, \
            create_backend(backend, peer_id="decode-0", secret=SECRET) as puller, \
            create_backend(backend, peer_id="decode-6", timeout_s=2.0) as stranger:
        owner.register_pool(make_pool(16, 1), LAYOUT, lease_guard=leases)
        for side in (puller, stranger):
            side.register_pool(make_pool(16, 2), LAYOUT)
        free_blocks.difference_update([3, 4])
        leases.pin("req-77f3", [3, 4])

        def serve_notifications() -> None:  # the owner's loop, as pdcluster.services.pools.worker runs it
            for note in owner.poll_notifications():
                leases.release(note.lease_id)

        if backend == "nixl":
            stranger.release(owner.describe(), "req-77f3")  # no secret: untagged
            assert wait_until(lambda: serve_notifications() or owner.num_rejected_notifications == 1)
        else:
            with pytest.raises(AuthenticationError):
                stranger.release(owner.describe(), "req-77f3")
        serve_notifications()
        assert leases.get("req-77f3") is not None and len(free_blocks) == 14
        puller.release(owner.describe(), "req-77f3")
        assert wait_until(lambda: serve_notifications() or leases.get("req-77f3") is None)
        assert len(free_blocks) == 16
    assert "req-77f3" not in caplog.text  # a dropped notification is logged without its payload


def test_an_authenticated_peer_still_needs_a_valid_tag_for_each_release(owner, caplog):
    """Tags bind sender, owner, owner epoch and lease: a peer of the cluster cannot
    release in another's name, and an old tag does not work on a restarted owner."""
    mac = ClusterSecret(SECRET).mac
    bad = {
        "untagged": encode_notification("req-1"),
        "in decode-0's name": encode_notification("req-1", mac(LEASE_RELEASE, "decode-0", "prefill-0",
                                                                owner.epoch, "req-1")),
        "for the previous epoch": encode_notification("req-1", mac(LEASE_RELEASE, "decode-9", "prefill-0",
                                                                    owner.epoch ^ 2, "req-1")),
        "another secret": encode_notification("req-1", ClusterSecret(OTHER_SECRET).mac(
            LEASE_RELEASE, "decode-9", "prefill-0", owner.epoch, "req-1")),
    }
    good = encode_notification("req-2", mac(LEASE_RELEASE, "decode-9", "prefill-0", owner.epoch, "req-2"))
    sock = connect(owner.descriptor())
    with sock:
        assert authenticate(sock, owner.descriptor(), SECRET, "decode-9")["ok"] is True
        deadline = Deadline(2.0, "test")
        send_frame(sock, {"op": "hello", "epoch": owner.epoch, "layout": LAYOUT.to_dict()}, deadline)
        for payload in [*bad.values(), good]:
            send_frame(sock, {"op": "notify", "payload": payload}, deadline)
        got = []
        assert wait_until(lambda: got.extend(owner.poll_notifications()) or got)
    assert [(n.from_peer, n.lease_id) for n in got] == [("decode-9", "req-2")]
    assert owner.num_rejected_notifications == len(bad)
    assert caplog.text.count("failed authentication") == len(bad)


def test_the_secret_is_checked_and_never_shown():
    with pytest.raises(ValueError, match="has 5 bytes, under the 16 required") as e:
        create_backend("fallback", secret=b"short")
    assert "short" not in str(e.value)
    with pytest.raises(TypeError, match="must be bytes, got str"):
        create_backend("fallback", secret="a-str-secret-of-enough-length")
    secret = ClusterSecret(SECRET)
    assert SECRET.decode() not in repr(secret)
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(secret)
    with create_backend("fallback", peer_id="prefill-0", secret=SECRET) as backend:
        backend.register_pool(make_pool(4, 0), LAYOUT)
        assert backend.authenticated
        shown = repr(backend) + repr(vars(backend)) + repr(backend.descriptor()) + repr(vars(backend.server))
        assert SECRET.decode() not in shown and SECRET.hex() not in shown
        assert SECRET not in backend.describe()


def test_a_refused_authentication_fails_at_once_not_at_the_timeout(owner):
    with create_backend("fallback", peer_id="decode-6", secret=OTHER_SECRET, timeout_s=120.0) as intruder:
        intruder.register_pool(make_pool(8, 2), LAYOUT)
        forged = owner.descriptor()
        forged = forged.signed(ClusterSecret(OTHER_SECRET).mac(DESCRIPTOR, forged.body()))
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            intruder.pull(forged, [0], [0])
        assert time.monotonic() - t0 < 60  # refused at once, not at the 120 s timeout (a hang guard)
