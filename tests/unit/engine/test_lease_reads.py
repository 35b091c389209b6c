"""The lease table as the block server sees it: reads allowed only under a
live lease, blocks never freed while read or before the grace is over, and
all of it safe across threads."""

import threading
import time
from collections import Counter

import pytest

from pdcluster.services.engine.lease import EXPIRY_GRACE_S, LeaseTable


class Pool:
    """Records every block given back; a block freed twice is a test failure."""

    def __init__(self):
        self.freed: Counter[int] = Counter()
        self._lock = threading.Lock()

    def free(self, blocks):
        with self._lock:
            self.freed.update(blocks)
            assert max(self.freed.values()) == 1, f"double free: {self.freed}"

    def any_freed(self, blocks) -> bool:
        with self._lock:
            return any(self.freed[b] for b in blocks)


def test_a_lease_carries_its_deadline_on_both_clocks():
    table = LeaseTable(Pool().free, default_ttl_s=30.0)
    wall_before, mono_before = time.time(), time.monotonic()
    lease = table.pin("a", [1, 2])
    wall_after, mono_after = time.time(), time.monotonic()  # brackets: a descheduled thread cannot break them
    assert wall_before + 30.0 <= lease.deadline_unix <= wall_after + 30.0
    assert mono_before + 30.0 <= lease.expires_at <= mono_after + 30.0
    assert table.expiry_grace_s == EXPIRY_GRACE_S == 1.0


def test_reads_need_a_live_lease_covering_every_block():
    table = LeaseTable(Pool().free)
    lease = table.pin("a", [1, 2, 3])
    assert table.begin_read("a", [1, 3]) is None
    table.end_read("a")
    assert table.begin_read("b", [1]) == "unknown or already released lease"
    assert table.begin_read("a", [3, 4, 9]) == "blocks [4, 9] are not in the lease"
    assert table.begin_read("a", [1], now=lease.expires_at).startswith("lease expired 0.000 s ago")
    assert table.num_refused_reads == 3
    with pytest.raises(ValueError, match="without a begin_read"):
        table.end_read("a")


def test_release_during_a_read_defers_the_free_to_the_engine_threads_next_expire():
    pool = Pool()
    table = LeaseTable(pool.free)
    table.pin("a", [1, 2])
    assert table.begin_read("a", [1, 2]) is None
    assert table.release("a") is True
    assert not pool.freed and table.num_pinned_blocks == 2 and len(table) == 0
    assert table.begin_read("a", [1]) == "unknown or already released lease"  # refused at once
    assert table.release("a") is False
    table.end_read("a")
    assert not pool.freed  # end_read runs on a server thread: it never frees
    assert table.expire() == []
    assert pool.freed == Counter({1: 1, 2: 1}) and table.num_pinned_blocks == 0


def test_expiry_refuses_reads_at_the_deadline_and_frees_after_the_grace():
    pool = Pool()
    table = LeaseTable(pool.free, expiry_grace_s=0.5)
    lease = table.pin("a", [4], ttl_s=1.0, now=99.0)
    assert lease.expires_at == 100.0
    assert table.begin_read("a", [4], now=99.9) is None
    assert table.begin_read("a", [4], now=100.0) is not None
    assert table.expire(now=100.4) == [] and not pool.freed and table.get("a") is lease
    assert table.expire(now=100.5) == ["a"] and table.num_expired == 1
    assert not pool.freed  # still read: the read that began before the deadline holds it
    table.end_read("a")
    table.expire(now=100.6)
    assert pool.freed == Counter({4: 1})


def test_a_reused_id_frees_the_old_blocks_only_after_every_read_of_that_id():
    pool = Pool()
    table = LeaseTable(pool.free)
    table.pin("a", [1])
    assert table.begin_read("a", [1]) is None
    table.release("a")
    table.pin("a", [2])  # a re-prefill under the same id
    assert table.begin_read("a", [2]) is None
    table.end_read("a")
    table.expire()
    assert not pool.freed  # one read of "a" is still going; it may be the old one
    table.end_read("a")
    table.expire()
    assert pool.freed == Counter({1: 1}) and table.get("a").block_ids == (2,)


def test_shorten_only_brings_the_deadline_forward():
    table = LeaseTable(Pool().free, default_ttl_s=30.0)
    long = table.pin("a", [1])
    short = table.shorten("a", 0.5)
    assert short.deadline_unix < long.deadline_unix and short.expires_at < long.expires_at
    assert table.shorten("a", 60.0) == short and table.shorten("zz", 1.0) is None


def test_pin_refuses_a_nonsense_ttl():
    table = LeaseTable(Pool().free)
    with pytest.raises(ValueError, match="lease ttl must be a finite number"):
        table.pin("a", [1], ttl_s=float("inf"))
    with pytest.raises(ValueError, match="expiry grace must be >= 0"):
        LeaseTable(Pool().free, expiry_grace_s=-1)


def test_threads_reading_while_the_engine_thread_releases_and_expires():
    """Readers never see their blocks freed mid-read; every block is freed
    exactly once in the end.  The engine thread pins, releases and expires
    leases until the readers have been let in and refused often enough, and
    leases have expired: progress, not a time window, so a starved machine
    only makes it slower (120 s is a hang guard)."""
    pool = Pool()
    table = LeaseTable(pool.free, default_ttl_s=0.02, expiry_grace_s=0.01)
    pinned, stop = [0], threading.Event()  # leases l0 .. l{pinned - 1} exist or existed
    errors: list[str] = []
    allowed = Counter()

    def reader(seed: int) -> None:
        i = seed
        while not stop.is_set():
            n = pinned[0]
            if n == 0:
                time.sleep(0)
                continue
            lid, blocks = f"l{i % n}", [2 * (i % n), 2 * (i % n) + 1]
            if table.begin_read(lid, blocks) is None:
                if pool.any_freed(blocks):
                    errors.append(f"{lid} read after its blocks were freed")
                time.sleep(0)
                if pool.any_freed(blocks):
                    errors.append(f"{lid} freed during a read")
                table.end_read(lid)
                allowed[seed] += 1
            i += 7

    def enough() -> bool:
        return sum(allowed.values()) > 100 and table.num_refused_reads > 100 and table.num_expired > 50

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    hang_guard = time.monotonic() + 120.0
    try:
        while not enough():
            assert time.monotonic() < hang_guard, (sum(allowed.values()), table.num_refused_reads, table.num_expired)
            i = pinned[0]
            table.pin(f"l{i}", [2 * i, 2 * i + 1])
            pinned[0] = i + 1
            if i % 3 == 0:
                table.release(f"l{i - 1 if i else 0}")
            table.expire()
            time.sleep(0.001)
        time.sleep(0.05)  # past every lease's ttl and grace (0.03 s)
    finally:
        stop.set()
        for t in threads:
            t.join()
    table.expire()
    assert not errors, errors[:3]
    assert len(table) == 0 and table.num_pinned_blocks == 0
    assert pool.freed == Counter({b: 1 for b in range(2 * pinned[0])})
