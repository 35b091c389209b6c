"""The other processes of the multi-process transfer tests.

``owner_main`` plays a prefill replica: a pool with known bytes, a LeaseTable
over a tiny free list (a stand-in for the engine's block pool), and a loop
that releases leases on notification and expires the rest.  ``puller_main``
plays a second decode replica.  ``OwnerProcess`` drives an owner from a test."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import torch

from pdcluster.services.engine.lease import LeaseTable
from pdcluster.transfer import KVLayout, create_backend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_size=4, model_fingerprint=7)
SPAWN = mp.get_context("spawn")
SECRET = b"integration-test-cluster-secret-42"  # every process of these tests is one cluster


def make_pool(num_blocks: int, seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """Random bit patterns (every byte value, NaNs included), reproducible from the seed."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks * layout.block_bytes,), dtype=torch.uint8, generator=g)
    return raw.view(layout.torch_dtype).view(num_blocks, *layout.block_shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class FreeList:
    def __init__(self, num_blocks: int) -> None:
        self.free = set(range(num_blocks))

    def take(self, n: int) -> list[int]:
        ids = sorted(self.free)[:n]
        if len(ids) < n:
            raise RuntimeError(f"only {len(self.free)} free blocks, {n} asked")
        self.free.difference_update(ids)
        return ids

    def give_back(self, ids: list[int]) -> None:
        self.free.update(ids)

    @property
    def count(self) -> int:
        return len(self.free)


def owner_main(conn: Any, backend_name: str, num_blocks: int, seed: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)

    def start(seed: int):
        backend = create_backend(backend_name, peer_id="prefill-0", secret=SECRET)
        backend.register_pool(make_pool(num_blocks, seed), LAYOUT)
        return backend

    backend = start(seed)
    free = FreeList(num_blocks)
    leases = LeaseTable(free.give_back, default_ttl_s=30.0)
    conn.send(("ready", backend.describe()))
    while True:
        for note in backend.poll_notifications():
            leases.release(note.lease_id)
        leases.expire()
        if not conn.poll(0.002):
            continue
        cmd, *args = conn.recv()
        if cmd == "pin":
            lease_id, n, ttl_s = args
            ids = free.take(n)
            leases.pin(lease_id, ids, ttl_s)
            conn.send(ids)
        elif cmd == "free_count":
            conn.send(free.count)
        elif cmd == "restart":  # a new epoch, new bytes, same peer_id
            backend.close()
            backend = start(args[0])
            conn.send(backend.describe())
        elif cmd == "exit":
            backend.close()
            conn.send("bye")
            return


def puller_main(conn: Any, backend_name: str, descriptor: bytes, owner_seed: int, owner_blocks: int,
                jobs: list[tuple[list[int], list[int]]], start: Any, run_s: float) -> None:
    torch.set_num_threads(1)
    backend = create_backend(backend_name, peer_id=f"decode-{os.getpid()}", secret=SECRET, timeout_s=10.0)
    pool = torch.zeros(owner_blocks, *LAYOUT.block_shape, dtype=LAYOUT.torch_dtype)
    backend.register_pool(pool, LAYOUT)
    reference = make_pool(owner_blocks, owner_seed)
    conn.send("ready")
    start.wait(60)
    conn.send(("done", *pull_jobs(backend, pool, reference, descriptor, jobs, run_s)))
    backend.close()


def pull_jobs(backend, pool, reference, descriptor, jobs, run_s: float) -> tuple[int, bool, float, float]:
    """Cycles through ``jobs`` for ``run_s`` seconds: (pulls, all identical, first start, last end)."""
    began = time.time()
    pulls, identical = 0, True
    while pulls < len(jobs) or time.time() - began < run_s:
        remote, local = jobs[pulls % len(jobs)]
        backend.pull(descriptor, remote, local)
        identical = identical and same_bytes(pool[local], reference[remote])
        pulls += 1
    return pulls, identical, began, time.time()


class OwnerProcess:
    def __init__(self, backend: str, num_blocks: int = 1024, seed: int = 1, env: dict[str, str] | None = None):
        self.backend, self.num_blocks, self.seed = backend, num_blocks, seed
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=owner_main, args=(child, backend, num_blocks, seed, env or {}), daemon=True)
        self.proc.start()
        self.descriptor = b""

    def wait_ready(self, timeout_s: float = 60.0) -> OwnerProcess:
        tag, self.descriptor = self._recv(timeout_s)
        assert tag == "ready"
        return self

    def call(self, *cmd: Any, timeout_s: float = 10.0) -> Any:
        self.conn.send(cmd)
        return self._recv(timeout_s)

    def restart(self, seed: int) -> None:
        self.descriptor = self.call("restart", seed)
        self.seed = seed

    def pause(self) -> None:
        """SIGSTOP, returning once the kernel reports the process stopped (delivery is asynchronous)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while _proc_state(self.proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.001)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        self.proc.join(10)

    def _signal(self, signum: int) -> None:
        try:
            os.kill(self.proc.pid, signum)
        except ProcessLookupError:
            pass  # already gone (and reaped)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.resume()
            try:
                self.call("exit", timeout_s=5)
            except (TimeoutError, EOFError, OSError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.kill()

    def _recv(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.backend} owner process sent nothing for {timeout_s} s")
        return self.conn.recv()


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def write_puller_main(conn: Any, descriptor: bytes, num_blocks: int, lease_id: str, env: dict[str, str],
                      pulls: Any) -> None:
    """A decode replica whose pulls the owner WRITEs: pulls every block under
    ``lease_id`` again and again (counting them in ``pulls``) until killed."""
    os.environ.update(env)
    torch.set_num_threads(1)
    backend = create_backend("nixl", peer_id=f"decode-{os.getpid()}", secret=SECRET, timeout_s=3.0,
                             pull_mode="write")
    backend.register_pool(torch.zeros(num_blocks, *LAYOUT.block_shape, dtype=LAYOUT.torch_dtype), LAYOUT)
    conn.send("ready")
    everything = list(range(num_blocks))
    while True:
        backend.pull(descriptor, everything, everything, notif=lease_id)
        pulls.value += 1
