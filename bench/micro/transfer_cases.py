"""What one KV-pull measurement is, shared by bench.micro.transfer_speed (two
processes on one host) and bench.micro.transfer_two_hosts (two network
namespaces): the SmolLM2-sized layout, the byte pattern an owner fills its
pool with, fragmented block lists, and the timing of one size."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

from pdcluster.transfer import KVLayout, TransferBackend, coalesce_block_runs, create_backend

SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_size=16,
                   model_fingerprint=0x5E0117)


def bench_backend(column: str, **options: object) -> TransferBackend:
    """The backend of one bench column: a registry name ("nixl" pulls in its
    default mode, "auto"), or "nixl-read" / "nixl-write" (NIXL in that pull mode)."""
    base, _, mode = column.partition("-")
    if base == "nixl" and mode:
        return create_backend("nixl", pull_mode=mode, **options)
    return create_backend(column, **options)


def fragmented_block_ids(num_blocks: int, pool_blocks: int, rng: random.Random, max_run: int = 32) -> list[int]:
    """``num_blocks`` distinct ids made of runs of 1..max_run consecutive blocks, runs in random order."""
    runs, start = [], 0
    while start < pool_blocks:
        length = min(rng.randint(1, max_run), pool_blocks - start)
        runs.append(range(start, start + length))
        start += length
    rng.shuffle(runs)
    return [b for run in runs for b in run][:num_blocks]


def fill_pattern(pool: torch.Tensor) -> None:
    """Block b holds a byte ramp rotated by b: distinct per block, cheap to rebuild."""
    u8 = pool.view(torch.uint8).view(pool.shape[0], -1)
    ramp = torch.arange(u8.shape[1], dtype=torch.int64).remainder(251).to(torch.uint8)
    for b in range(u8.shape[0]):
        u8[b] = ramp.roll(b)


def reps_for(num_blocks: int, scale: float) -> int:
    return max(3, int(scale * (300 if num_blocks == 1 else 2000 / num_blocks + 4)))


def measure_size(n: int, pullers: dict[str, TransferBackend], descriptors: dict[str, bytes], pool: torch.Tensor,
                 memcpy_src: torch.Tensor, rng: random.Random, reps: int) -> dict[str, float]:
    """Median seconds per case.  Every repetition touches other blocks of the
    (larger than cache) pools, so memcpy and pulls all run from cold memory."""
    pool_blocks = pool.shape[0]
    plans = [(fragmented_block_ids(n, pool_blocks, rng), fragmented_block_ids(n, pool_blocks, rng),
              rng.randrange(pool_blocks - n + 1), rng.randrange(pool_blocks - n + 1)) for _ in range(reps)]
    times: dict[str, list[float]] = {}

    def timed(key: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        fn()
        times.setdefault(key, []).append(time.perf_counter() - t0)

    for remote, local, src_at, dst_at in plans:  # interleaved: every case sees the same background load
        timed("memcpy", lambda: pool[dst_at:dst_at + n].copy_(memcpy_src[src_at:src_at + n]))
        for name, backend in pullers.items():
            timed(name, lambda: backend.pull(descriptors[name], remote, local, notif="bench-lease"))
        if "nixl" in pullers:
            run_r, run_l = list(range(src_at, src_at + n)), list(range(dst_at, dst_at + n))
            timed("nixl 1-run", lambda: pullers["nixl"].pull(descriptors["nixl"], run_r, run_l, notif="bench-lease"))
    result = {key: statistics.median(ts) for key, ts in times.items()}
    result["descs_raw"] = n
    result["descs_coalesced"] = statistics.median(len(coalesce_block_runs(r, loc)) for r, loc, _, _ in plans)
    remote, local = plans[-1][0], plans[-1][1]
    for name, backend in pullers.items():  # the last pull of this size must have moved the right bytes
        backend.pull(descriptors[name], remote, local)
        check_bytes(pool, remote, local, name)
    return result


def check_bytes(pool: torch.Tensor, remote: list[int], local: list[int], backend: str) -> None:
    expected = torch.empty(1, *pool.shape[1:], dtype=pool.dtype)
    for i in random.Random(len(remote)).sample(range(len(remote)), min(8, len(remote))):
        u8 = expected.view(torch.uint8).view(1, -1)
        u8[0] = torch.arange(u8.shape[1]).remainder(251).to(torch.uint8).roll(remote[i])
        if not torch.equal(pool[local[i]].view(torch.uint8), expected[0].view(torch.uint8)):
            raise SystemExit(f"{backend} delivered wrong bytes for remote block {remote[i]}: benchmark invalid")
