"""An idle NIXL owner's tick goes quiet (pdcluster/transfer/nixl_backend.py): the
rule exactly; the engine's lease table tells the owner of every pin; and a
quiet owner still serves what follows a pin -- a READ on one host, and a
pull by the owner's WRITE with its lease checked and its release heard."""

import pytest
from transfer_lease_fakes import LAYOUT, make_pool, pull_backend, same_bytes, wait_until
from transfer_raw_client import SECRET

from pdcluster.services.engine.lease import LeaseTable
from pdcluster.transfer import nixl_backend
from pdcluster.transfer.nixl_backend import _QUIET_AFTER_S, _QUIET_TICK_S, idle_tick_s


def test_the_tick_goes_quiet_only_after_the_quiet_time_and_only_when_pins_wake_it():
    assert idle_tick_s(0.005, 0.0, may_go_quiet=True) == 0.005
    assert idle_tick_s(0.005, _QUIET_AFTER_S, may_go_quiet=True) == 0.005
    assert idle_tick_s(0.005, _QUIET_AFTER_S + 0.1, may_go_quiet=True) == _QUIET_TICK_S
    assert idle_tick_s(0.005, 3600.0, may_go_quiet=False) == 0.005  # a guard that does not tell of its pins
    assert idle_tick_s(1.0, 3600.0, may_go_quiet=True) == 1.0        # never faster than configured


def test_the_lease_table_calls_its_pin_listeners_after_the_pin():
    leases = LeaseTable(lambda _blocks: None)
    seen = []
    leases.add_pin_listener(lambda: seen.append(leases.num_pinned_blocks))
    leases.pin("a", [1, 2])
    leases.pin("b", [3])
    assert seen == [2, 3]  # each listener runs once the lease is in the table
    with pytest.raises(KeyError):
        leases.pin("a", [4])
    assert seen == [2, 3]  # a refused pin tells nobody


@pytest.mark.parametrize("kind", ["nixl", "nixl-write"])
def test_a_quiet_owner_serves_the_pull_that_follows_a_pin(monkeypatch, kind):
    monkeypatch.setattr(nixl_backend, "_QUIET_AFTER_S", 0.0)  # quiet from the start, between any two events
    free = set(range(16))
    leases = LeaseTable(free.update, default_ttl_s=30.0)
    owner = pull_backend(kind, peer_id="prefill-0", secret=SECRET)
    puller = pull_backend(kind, peer_id="decode-0", secret=SECRET, timeout_s=10.0)
    try:
        owner_pool, puller_pool = make_pool(16, 1), make_pool(4, 2)
        owner.register_pool(owner_pool, LAYOUT, lease_guard=leases)
        puller.register_pool(puller_pool, LAYOUT)
        assert owner._may_go_quiet
        owner._last_activity = 0.0  # nothing else touches it before the pull: no notification, no write
        free.difference_update([5, 6])
        lease = leases.pin("req-1", [5, 6])
        assert owner._last_activity > 0.0  # the pin woke the owner's ticker
        puller.pull(owner.describe(), [5, 6], [0, 1], notif="req-1", lease_deadline_unix=lease.deadline_unix)
        assert same_bytes(puller_pool[:2], owner_pool[5:7])
        notes = []
        assert wait_until(lambda: notes.extend(owner.poll_notifications()) or bool(notes), timeout_s=10.0)
        assert [n.lease_id for n in notes] == ["req-1"] and leases.release("req-1")
        # the owner's thread ends its read after the last byte left (it may trail the pull's return and
        # the release); blocks whose reader ended after the release are freed by the table's next
        # periodic pass, which the engine runs every step and idle wake (Engine.expire_stale)
        def all_free() -> bool:
            leases.expire()
            return len(free) == 16 and leases.num_pinned_blocks == 0

        assert wait_until(all_free, timeout_s=10.0), (len(free), leases.num_pinned_blocks)
    finally:
        puller.close()
        owner.close()
