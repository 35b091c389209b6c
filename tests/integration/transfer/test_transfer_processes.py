"""KV transfer between real OS processes, each holding its own pool, through
both backends: byte identity, concurrent pullers, leases, handshakes, and
owners that stall or die mid-pull."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from pdcluster.transfer import KVLayout, LayoutMismatchError, TransferError, create_backend
from pdcluster.transfer.errors import TransferInDoubtError
from pdcluster.services.engine.lease import LeaseTable
from transfer_peer_proc import (LAYOUT, SECRET, SPAWN, FreeList, OwnerProcess, make_pool, pull_jobs, puller_main,
                                same_bytes, write_puller_main)

pytestmark = pytest.mark.integration
BACKENDS = ["nixl", "fallback"]
OWNER_BLOCKS = 1024  # 1 KiB blocks: a 1 MiB pool


@pytest.fixture(scope="module")
def owners():
    procs = {name: OwnerProcess(name, OWNER_BLOCKS) for name in BACKENDS}  # start both, then wait
    try:
        yield {name: proc.wait_ready() for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture
def puller(request):
    backend = create_backend(request.param, peer_id="decode-0", secret=SECRET, timeout_s=5.0)
    pool = torch.zeros(OWNER_BLOCKS, *LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
    backend.register_pool(pool, LAYOUT)
    yield backend, pool
    backend.close()


def random_jobs(rng: random.Random, n: int) -> list[tuple[list[int], list[int]]]:
    """Single blocks, long consecutive runs, scattered ids and mixes of them."""
    jobs = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            remote, local = [rng.randrange(OWNER_BLOCKS)], [rng.randrange(OWNER_BLOCKS)]
        elif kind == 1:
            length = rng.randint(64, 512)
            r0, l0 = rng.randrange(OWNER_BLOCKS - length), rng.randrange(OWNER_BLOCKS - length)
            remote, local = list(range(r0, r0 + length)), list(range(l0, l0 + length))
        elif kind == 2:
            k = rng.randint(2, 200)
            remote, local = rng.sample(range(OWNER_BLOCKS), k), rng.sample(range(OWNER_BLOCKS), k)
        else:
            remote = [b for s in rng.sample(range(0, OWNER_BLOCKS, 16), 6) for b in range(s, s + rng.randint(1, 16))]
            local = rng.sample(range(OWNER_BLOCKS), len(remote))
        jobs.append((remote, local))
    return jobs


@pytest.mark.parametrize("puller", BACKENDS, indirect=True)
def test_random_block_lists_arrive_byte_identical(owners, puller):
    backend, pool = puller
    owner = owners[backend.name]
    reference = make_pool(OWNER_BLOCKS, owner.seed)
    for remote, local in random_jobs(random.Random(11), 40):
        stats = backend.pull(owner.descriptor, remote, local)
        assert same_bytes(pool[local], reference[remote]), (len(remote), stats)
    assert backend.num_handshakes == 1


@pytest.mark.parametrize("puller", BACKENDS, indirect=True)
def test_two_decoders_pull_from_one_owner_at_once(owners, puller):
    backend, pool = puller
    owner = owners[backend.name]
    jobs = random_jobs(random.Random(5), 24)
    conn, child = SPAWN.Pipe()
    start = SPAWN.Event()
    other = SPAWN.Process(target=puller_main, daemon=True,
                          args=(child, backend.name, owner.descriptor, owner.seed, OWNER_BLOCKS, jobs, start, 0.6))
    other.start()
    try:
        assert conn.poll(60) and conn.recv() == "ready"
        start.set()
        mine = pull_jobs(backend, pool, make_pool(OWNER_BLOCKS, owner.seed), owner.descriptor, jobs, 0.6)
        assert conn.poll(30)
        tag, *theirs = conn.recv()
    finally:
        other.join(10)
        if other.is_alive():
            other.kill()
    assert mine[1] and theirs[1], "a concurrent pull delivered wrong bytes"
    assert min(mine[3], theirs[3]) > max(mine[2], theirs[2]), "the two decoders never pulled at the same time"


@pytest.mark.parametrize("puller", BACKENDS, indirect=True)
def test_owner_leases_are_released_by_notification_or_expiry(owners, puller):
    backend, pool = puller
    owner = owners[backend.name]
    total = owner.call("free_count")
    pulled = owner.call("pin", "lease-pulled", 8, 30.0)
    owner.call("pin", "lease-abandoned", 5, 0.5)  # its puller "died": nobody will notify
    assert owner.call("free_count") == total - 13
    backend.pull(owner.descriptor, pulled, list(range(8)), notif="lease-pulled")
    wait_until(lambda: owner.call("free_count") == total - 5, 5.0, "the notified lease was not released")
    wait_until(lambda: owner.call("free_count") == total, 5.0, "the abandoned lease did not expire")


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_mismatch_is_refused_with_both_sides_named(owners, backend):
    other = KVLayout(num_layers=2, num_kv_heads=1, head_dim=32, dtype="bfloat16", block_size=4, model_fingerprint=8)
    with create_backend(backend, peer_id="decode-9", secret=SECRET) as puller:
        puller.register_pool(make_pool(4, 0, other), other)
        with pytest.raises(LayoutMismatchError) as e:
            puller.pull(owners[backend].descriptor, [0], [0])
    message = str(e.value)
    assert "decode-9" in message and "prefill-0" in message
    assert "num_kv_heads: 1 here vs 2 on prefill-0" in message
    assert "model_fingerprint: 0x0000000000000008 here vs 0x0000000000000007 on prefill-0" in message


@pytest.mark.parametrize("puller", BACKENDS, indirect=True)
def test_restarted_owner_is_rehandshaken(owners, puller):
    backend, pool = puller
    owner = owners[backend.name]
    stale = owner.descriptor
    backend.pull(stale, [1], [1])
    owner.restart(seed=owner.seed + 100)
    backend.pull(owner.descriptor, list(range(64)), list(range(64)))
    assert same_bytes(pool[:64], make_pool(OWNER_BLOCKS, owner.seed)[:64])
    assert backend.num_handshakes == 2
    with pytest.raises(TransferError):
        backend.pull(stale, [1], [1])


@pytest.mark.parametrize("backend, env", [
    ("fallback", {}), ("nixl", {}),
    ("nixl", {"UCX_TLS": "tcp"}),  # pull mode "auto" picks the owner's WRITE over TCP
], ids=["fallback", "nixl", "nixl-write-tcp"])
def test_killing_the_owner_mid_pull_raises_within_the_timeout(backend, env, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # read when this process's NIXL agent is created
    owner = OwnerProcess(backend, num_blocks=4096, env=env).wait_ready()  # 4 MiB: each pull takes milliseconds
    timeout_s = 2.0
    try:
        with create_backend(backend, peer_id="decode-0", secret=SECRET, timeout_s=timeout_s) as puller:
            puller.register_pool(torch.zeros(4096, *LAYOUT.block_shape, dtype=LAYOUT.torch_dtype), LAYOUT)
            free, remote = FreeList(4096), list(range(4096))
            puller.pull(owner.descriptor, [0], [0])  # handshakes (both ways when the owner WRITEs) before the clock
            killed_at: list[float] = []
            killer = threading.Timer(0.3, lambda: (killed_at.append(time.monotonic()), owner.kill()))
            killer.start()
            pulls, began = 0, time.monotonic()
            with pytest.raises(TransferError):
                while time.monotonic() - began < 10:
                    local = free.take(4096)
                    try:
                        puller.pull(owner.descriptor, remote, local)
                    finally:
                        free.give_back(local)  # the decode side frees its blocks on failure, too
                    pulls += 1
            failed_at = time.monotonic()
            killer.join()
            assert pulls > 0 and killed_at, "the owner was not killed while pulls were running"
            assert failed_at - killed_at[0] < timeout_s
            assert free.count == 4096
            t0 = time.monotonic()
            with pytest.raises(TransferError):
                puller.pull(owner.descriptor, [0], [0])  # a dead peer keeps failing, fast
            assert time.monotonic() - t0 < timeout_s
    finally:
        owner.stop()


@pytest.mark.parametrize("backend, env, stalls", [
    ("fallback", {}, True),
    ("nixl", {}, False),  # same-host READ (UCX cma) needs nothing from the owner
    ("nixl", {"UCX_TLS": "tcp"}, True),  # a transport that does: the timeout must fire
], ids=["fallback", "nixl-cma", "nixl-tcp"])
def test_a_stalled_owner_times_out_or_is_not_needed(backend, env, stalls, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # read when this process's NIXL agent is created
    owner = OwnerProcess(backend, num_blocks=64, env=env).wait_ready()
    try:
        with create_backend(backend, peer_id="decode-0", secret=SECRET, timeout_s=1.0) as puller:
            pool = torch.zeros(64, *LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
            puller.register_pool(pool, LAYOUT)
            puller.pull(owner.descriptor, [0], [0])
            owner.pause()
            t0 = time.monotonic()
            stalled = None
            if stalls:
                # Over TCP the owner WRITEs: a pull that timed out before it answered is in doubt (the
                # owner may still write) until its late answer comes.
                with pytest.raises(TransferError, match="timed out") as stalled:
                    puller.pull(owner.descriptor, list(range(64)), list(range(64)))
                assert 1.0 <= time.monotonic() - t0 < 2.0
                assert isinstance(stalled.value, TransferInDoubtError) == (getattr(puller, "pull_mode", "") == "write")
            else:
                puller.pull(owner.descriptor, list(range(64)), list(range(64)))
                assert time.monotonic() - t0 < 1.0
            owner.resume()
            if stalled is not None and isinstance(stalled.value, TransferInDoubtError):
                wait_until(stalled.value.settled, 30.0, "the resumed owner's answer never settled the doubt")
            puller.pull(owner.descriptor, list(range(64)), list(range(64)))  # recovers once the owner does
            assert same_bytes(pool, make_pool(64, owner.seed))
    finally:
        owner.stop()


def test_a_puller_killed_mid_write_leaves_every_block_freeable(monkeypatch):
    """The owner WRITEs 16 MiB per pull over TCP; SIGKILL the puller while one
    is in flight: the owner's write fails or expires, its lease read ends, and
    once the lease is released every block is back in the free list."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    num_blocks = 16384
    free = FreeList(num_blocks)
    leases = LeaseTable(free.give_back, default_ttl_s=30.0)
    with create_backend("nixl", peer_id="prefill-0", secret=SECRET) as owner:
        owner.register_pool(make_pool(num_blocks, 3), LAYOUT, lease_guard=leases)
        leases.pin("req-1", free.take(num_blocks))
        conn, child = SPAWN.Pipe()
        pulls = SPAWN.Value("i", 0)
        puller = SPAWN.Process(target=write_puller_main, daemon=True,
                               args=(child, owner.describe(), num_blocks, "req-1", {"UCX_TLS": "tcp"}, pulls))
        puller.start()
        try:
            assert conn.poll(60) and conn.recv() == "ready"
            wait_until(lambda: pulls.value >= 1, 30.0, "the puller never completed a pull")
            wait_until(lambda: owner._writer._inflight, 10.0, "no write was ever in flight")
            puller.kill()
            puller.join(10)
            killed_at = time.monotonic()
            wait_until(lambda: not owner._writer.busy, 10.0, "the owner's write to a dead puller never ended")
            assert time.monotonic() - killed_at < 4.0  # the request's expiry (the puller's 3 s timeout) at most
        finally:
            if puller.is_alive():
                puller.kill()
        assert leases.release("req-1")
        assert free.count == num_blocks, "a lease read never ended: its blocks stay pinned"
        assert owner._writer.num_written == pulls.value or owner._writer.num_written == pulls.value + 1


def wait_until(predicate, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(message)
        time.sleep(0.02)
