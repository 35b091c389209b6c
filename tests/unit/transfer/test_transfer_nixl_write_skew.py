"""Pull mode "write" with the two hosts' clocks apart (issue 33).  The owner
counts a request's time-to-live on its own clock from its receipt, so a skew
of either sign neither lets it write after the puller gave up and freed its
blocks, nor makes it refuse a request the puller still waits for.

Real NIXL agents in one process; the owner's ``time`` (pdcluster.transfer.nixl_writer's)
is replaced by another host's: time.time() off by the skew, time.monotonic()
on an origin of its own, which the test moves forward by hand where an outcome
would otherwise depend on how soon this machine runs the owner's ticker."""

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from transfer_lease_fakes import guarded_owner_and_puller, same_bytes, wait_until

import pdcluster.transfer.nixl_write_puller as write_puller
import pdcluster.transfer.nixl_writer as nixl_writer
from pdcluster.transfer.errors import TransferInDoubtError

SKEWS_S = [-30.0, -2.0, 2.0, 30.0]  # the owner's clock behind the puller's (< 0) or ahead of it
GIVE_UP_S = 1.0  # the held pull's timeout: it always runs out, nothing answers it


class OtherHostClock:
    """The time module as the owner's host reads it."""

    def __init__(self, skew_s: float) -> None:
        self.skew_s = skew_s
        self.advanced_s = 0.0  # time the test let pass on the owner's monotonic clock, above the real

    def time(self) -> float:
        return time.time() + self.skew_s

    def monotonic(self) -> float:
        return time.monotonic() + 7_000.0 + self.skew_s + self.advanced_s

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.fixture
def guarded():
    """A NIXL owner of 64 blocks behind a FakeLeases guard, and a puller of 48 that asks for WRITEs."""
    yield from guarded_owner_and_puller("nixl-write")


def skew_owner_clock(monkeypatch, skew_s: float) -> OtherHostClock:
    clock = OtherHostClock(skew_s)
    monkeypatch.setattr(nixl_writer, "time", clock)
    return clock


@contextmanager
def service_held(owner) -> Iterator[None]:
    """The owner's ticker keeps routing notifications (a request is received,
    its stop time fixed) but starts no request and answers none."""
    owner._writer.service = lambda: None
    try:
        yield
    finally:
        del owner._writer.service


@pytest.mark.parametrize("skew_s", [0.0, *SKEWS_S])
def test_a_write_succeeds_whatever_the_owner_clock_reads(guarded, monkeypatch, skew_s):
    leases, owner, puller, owner_pool, puller_pool = guarded
    skew_owner_clock(monkeypatch, skew_s)
    deadline = leases.lend("req-1", [5, 6, 7, 20])
    puller.pull(owner.describe(), [5, 6, 7, 20], [0, 1, 2, 9], notif="req-1", lease_deadline_unix=deadline)
    assert same_bytes(puller_pool[[0, 1, 2, 9]], owner_pool[[5, 6, 7, 20]])
    assert wait_until(lambda: len(leases.calls) == 2)  # end_read runs on the owner's ticker, after the count
    assert leases.calls == [("begin", "req-1", (5, 6, 7, 20), None), ("end", "req-1")]
    assert owner._writer.num_written == 1 and owner._writer.num_refused == 0


@pytest.mark.parametrize("skew_s", SKEWS_S)
def test_an_owner_that_gets_to_a_request_after_the_puller_gave_up_writes_nothing(guarded, monkeypatch, skew_s):
    leases, owner, puller, _, puller_pool = guarded
    clock = skew_owner_clock(monkeypatch, skew_s)
    leases.lend("req-0", [9])
    puller.pull(owner.describe(), [9], [9], notif="req-0")  # connected: the held pull below only sends
    assert wait_until(lambda: len(leases.calls) == 2)  # and that write is over on the owner (end_read)
    leases.lend("req-1", [5, 6])
    sentinel = puller_pool.clone()
    monkeypatch.setattr(write_puller, "_cancel", lambda *args: None)  # the cancellation is lost (best effort)
    refused = owner._writer.num_refused
    with service_held(owner):
        with pytest.raises(TransferInDoubtError, match="timed out before the owner answered") as e:
            puller.pull(owner.describe(), [5, 6], [0, 1], notif="req-1", timeout_s=GIVE_UP_S)
        # the puller gave up; blocks 0 and 1 are held (not reused) until the owner answers
        assert e.value.local_block_ids == (0, 1) and not e.value.settled()
        assert wait_until(lambda: len(owner._writer._pending) == 1)  # its request sits received on the owner
        clock.advanced_s = GIVE_UP_S  # the owner's own clock saw the puller's whole wait pass
    assert wait_until(e.value.settled)  # the owner's late answer came: it stopped
    assert owner._writer.num_refused == refused + 1  # answered "expired", never written
    assert same_bytes(puller_pool, sentinel)
    assert owner._writer.num_written == 1  # the connecting pull's, none since
    assert [c[:2] for c in leases.calls] == [("begin", "req-0"), ("end", "req-0")]  # no read of req-1 begun


def test_a_cancellation_that_came_with_its_request_stops_it_before_it_starts(guarded, monkeypatch):
    # The owner's clock runs slow here (its ttl has not run out when it gets to the request), so only
    # the puller's cancellation, routed in the same tick as the request, keeps the write from starting.
    leases, owner, puller, _, puller_pool = guarded
    clock = skew_owner_clock(monkeypatch, 0.0)
    leases.lend("req-0", [9])
    puller.pull(owner.describe(), [9], [9], notif="req-0")
    assert wait_until(lambda: len(leases.calls) == 2)
    leases.lend("req-1", [5, 6])
    sentinel = puller_pool.clone()
    with service_held(owner):
        with pytest.raises(TransferInDoubtError) as e:
            puller.pull(owner.describe(), [5, 6], [0, 1], notif="req-1", timeout_s=GIVE_UP_S)
        assert wait_until(lambda: len(owner._writer._pending) == 1 and len(owner._writer._cancelled) == 1)
        clock.advanced_s = -60.0  # the request's ttl has not run out on the owner's clock
    assert wait_until(e.value.settled)
    assert same_bytes(puller_pool, sentinel) and owner._writer.num_written == 1
    assert [c[:2] for c in leases.calls] == [("begin", "req-0"), ("end", "req-0")]
