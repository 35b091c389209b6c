"""Pull mode "write": the owner moves the bytes with a NIXL WRITE at the
puller's signed request.  The pure parts (mode rule, replay window, message
codec) exactly; then real NIXL agents in one process: the owner checks the
lease on every pull and ends every read it began, and refuses forged,
replayed and out-of-range requests without writing a byte (expired ones, and
clock skew: test_transfer_nixl_write_skew)."""

import pytest
from transfer_lease_fakes import guarded_owner_and_puller, lease_ids_notified, same_bytes, wait_until
from transfer_raw_client import SECRET

from pdcluster.transfer import LeaseExpiredError, TransferError
from pdcluster.transfer.auth import ClusterSecret
from pdcluster.transfer.deadline import Deadline
from pdcluster.transfer.nixl_write_puller import _await, owner_ttl_s
from pdcluster.transfer.peer import PeerDescriptor
from pdcluster.transfer.pull_mode import choose_pull_mode
from pdcluster.transfer.replay_window import ReplayWindow
from pdcluster.transfer.runs import BlockRun
from pdcluster.transfer.wire import unpack
from pdcluster.transfer.write_request import MAX_TTL_S, WriteDone, WriteRequest, decode, sign_done, sign_request, verify


@pytest.mark.parametrize("setting, env, mode", [
    ("auto", {"UCX_NET_DEVICES": "lo"}, "read"),  # one host, cma: READ is one-sided
    ("auto", {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}, "write"),  # READ would be emulated over TCP
    ("auto", {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,cma"}, "read"),
    ("auto", {"UCX_NET_DEVICES": "lo", "UCX_TLS": "^cma"}, "write"),
    ("auto", {"UCX_NET_DEVICES": "eth0"}, "write"),  # KV leaves the host
    ("auto", {}, "write"),
    ("read", {"UCX_NET_DEVICES": "eth0"}, "read"),
    ("write", {"UCX_NET_DEVICES": "lo"}, "write"),
])
def test_the_pull_mode_rule(setting, env, mode):
    assert choose_pull_mode(setting, env) == mode


def test_an_unknown_pull_mode_names_the_choices():
    with pytest.raises(ValueError, match=r"pull_mode must be one of \('auto', 'read', 'write'\)"):
        choose_pull_mode("push", {})


def test_the_replay_window_accepts_each_seq_once_and_nothing_too_old():
    w = ReplayWindow(window=4, max_pullers=2)
    assert [w.accept("a", s) for s in (1, 3, 2, 3, 1)] == [True, True, True, False, False]
    assert w.accept("a", 10) and not w.accept("a", 6) and w.accept("a", 7)  # 6 is out of the window of 10
    assert w.accept("b", 1) and w.accept("c", 1)  # "a" is dropped: the least recently seen
    assert w.accept("a", 10)  # forgotten; its old requests have expired by then (see the module)


def test_messages_round_trip_and_tags_bind_both_agents():
    secret = ClusterSecret(SECRET)
    req = sign_request(WriteRequest(7, "lease-1", (BlockRun(3, 0, 2), BlockRun(9, 5, 1)), 2.5, b"desc"),
                       secret, "decode-0#1", "prefill-0#2")
    back = decode(unpack(req.encode(), 1 << 16, "test"), "decode-0#1")
    assert back == req and verify(back, secret, "decode-0#1", "prefill-0#2")
    assert not verify(back, secret, "decode-1#1", "prefill-0#2")  # another puller cannot reuse it
    assert not verify(back, secret, "decode-0#1", "prefill-0#3")  # nor the owner's next incarnation
    assert not verify(back, ClusterSecret(b"another-cluster-secret!!"), "decode-0#1", "prefill-0#2")
    done = sign_done(WriteDone(7, False, "refused", "no"), secret, "prefill-0#2", "decode-0#1")
    assert verify(decode(unpack(done.encode(), 4096, "test"), "x"), secret, "prefill-0#2", "decode-0#1")


BAD_TTLS = [1, 0.0, -1.0, float("nan"), float("inf"), MAX_TTL_S + 1.0, None]


@pytest.mark.parametrize("bad", [{"seq": 0}, {"seq": "1"}, {"runs": []}, {"runs": [[0, 0, 0]]},
                                 {"runs": [[-1, 0, 1]]}, {"lease": ""}, {"puller": "x"},
                                 *({"ttl": ttl} for ttl in BAD_TTLS)])
def test_malformed_requests_are_typed_errors(bad):
    obj = {"op": "write", "seq": 1, "lease": None, "runs": [[0, 0, 1]], "ttl": 1.0, "puller": b"d", **bad}
    with pytest.raises(TransferError, match="malformed write-path message from 'decode-0'"):
        decode(obj, "decode-0")


def test_a_request_carrying_a_time_of_day_is_a_typed_error():
    """The format before issue 33 (``expires``, the puller's time.time()) is refused, not misread as a ttl."""
    obj = {"op": "write", "seq": 1, "lease": None, "runs": [[0, 0, 1]], "expires": 1.0e9, "puller": b"d"}
    with pytest.raises(TransferError, match="malformed write-path message"):
        decode(obj, "decode-0")


@pytest.mark.parametrize("ttl_s", BAD_TTLS)
def test_a_request_is_built_only_with_a_bounded_positive_ttl(ttl_s):
    with pytest.raises(ValueError, match="ttl_s must be a finite float"):
        WriteRequest(1, None, (BlockRun(0, 0, 1),), ttl_s, b"d")


def test_the_owner_gets_the_puller_wait_less_a_margin_of_at_most_a_quarter():
    assert owner_ttl_s(10.0) == 9.75  # the margin, OWNER_STOP_MARGIN_S
    assert owner_ttl_s(0.4) == pytest.approx(0.3)  # a quarter of a short wait
    assert owner_ttl_s(5000.0) == MAX_TTL_S  # stops early rather than being refused


@pytest.fixture
def guarded():
    """A NIXL owner of 64 blocks behind a FakeLeases guard, and a puller of 48 that asks for WRITEs."""
    yield from guarded_owner_and_puller("nixl-write")


def test_a_written_pull_is_checked_against_the_lease_and_its_read_ended(guarded):
    leases, owner, puller, owner_pool, puller_pool = guarded
    deadline = leases.lend("req-1", [5, 6, 7, 20])
    puller.pull(owner.describe(), [5, 6, 7, 20], [0, 1, 2, 9], notif="req-1", lease_deadline_unix=deadline)
    assert same_bytes(puller_pool[[0, 1, 2, 9]], owner_pool[[5, 6, 7, 20]])
    assert wait_until(lambda: len(leases.calls) == 2)  # end_read runs on the owner's ticker
    assert leases.calls == [("begin", "req-1", (5, 6, 7, 20), None), ("end", "req-1")]
    assert lease_ids_notified(owner, count=1) == ["req-1"] and owner._writer.num_written == 1


@pytest.mark.parametrize("case", ["expired", "unknown", "blocks outside it"])
def test_a_write_outside_a_live_lease_is_refused_and_lands_nothing(guarded, case):
    leases, owner, puller, owner_pool, puller_pool = guarded
    if case != "unknown":
        leases.lend("req-1", [5, 6], ttl_s=-1.0 if case == "expired" else 30.0)
    remote = [5, 6, 7] if case == "blocks outside it" else [5, 6]
    before = puller_pool.clone()
    with pytest.raises(LeaseExpiredError, match=r"lease 'req-1' from prefill-0 expired .*owner refused"):
        puller.pull(owner.describe(), remote, list(range(len(remote))), notif="req-1")
    assert same_bytes(puller_pool, before)
    assert [c[0] for c in leases.calls] == ["begin"]  # refused: no read to end
    assert lease_ids_notified(owner, settle_s=0.1) == []
    leases.lend("req-2", [9])
    puller.pull(owner.describe(), [9], [0], notif="req-2")  # the refusal left the connection usable
    assert same_bytes(puller_pool[0], owner_pool[9]) and puller.num_handshakes == 1


def test_a_guarded_owner_refuses_a_write_naming_no_lease(guarded):
    _, owner, puller, _, _ = guarded
    with pytest.raises(TransferError, match="lease_required.*pass the hand-off's lease id") as e:
        puller.pull(owner.describe(), [5], [0])
    assert not isinstance(e.value, LeaseExpiredError)


def signed_request(puller, owner, runs, ttl_s=2.0, secret=SECRET, lease=None):
    """A hand-made request (runs unchecked by the puller) to ``owner``, and its seq."""
    desc = PeerDescriptor.decode(owner.describe())
    puller._ensure_remote_agent(desc)
    seq = puller._mailbox.open()
    req = sign_request(WriteRequest(seq, lease, tuple(runs), ttl_s, puller._own_descriptor()),
                       ClusterSecret(secret), puller.agent_name, desc.agent_name)
    return req.encode(), seq


def send_request(puller, owner, encoded, seq):
    """Sends an encoded request; the owner's answer, or None when none came within 1 s."""
    desc = PeerDescriptor.decode(owner.describe())
    puller._mailbox._waiting.add(seq)
    puller._send(desc, encoded, Deadline(1.0, "test send"))
    try:
        return _await(puller, seq, Deadline(1.0, "test wait"), desc)[1]
    except TransferError:
        return None


def test_runs_outside_either_pool_are_refused_before_a_byte_moves(guarded):
    leases, owner, puller, _, puller_pool = guarded
    leases.lend("req-1", range(64))
    before = puller_pool.clone()
    for runs in ([BlockRun(60, 0, 8)], [BlockRun(0, 45, 4)]):  # past the owner's 64, past the puller's 48
        done = send_request(puller, owner, *signed_request(puller, owner, runs, lease="req-1"))
        assert done is not None and not done.ok and done.code == "refused" and "outside" in done.error
    assert same_bytes(puller_pool, before) and leases.calls == [] and owner._writer.num_written == 0


def test_forged_and_replayed_requests_write_nothing(guarded):
    leases, owner, puller, owner_pool, puller_pool = guarded
    leases.lend("req-1", range(64))
    before = puller_pool.clone()
    forged = signed_request(puller, owner, [BlockRun(1, 0, 1)], secret=b"not-this-cluster-secret!", lease="req-1")
    assert send_request(puller, owner, *forged) is None  # dropped unanswered: a forger learns nothing
    assert wait_until(lambda: owner.num_rejected_notifications == 1)
    assert same_bytes(puller_pool, before) and leases.calls == []
    good = signed_request(puller, owner, [BlockRun(2, 1, 1)], lease="req-1")
    assert send_request(puller, owner, *good).ok
    assert same_bytes(puller_pool[1], owner_pool[2]) and wait_until(lambda: len(leases.calls) == 2)
    puller_pool[1] = before[1]
    assert send_request(puller, owner, *good) is None  # the same bytes once more: a replay
    assert wait_until(lambda: owner.num_rejected_notifications == 2)
    assert same_bytes(puller_pool[1], before[1]) and owner._writer.num_written == 1 and len(leases.calls) == 2
