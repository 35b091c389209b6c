"""Which bytes a pull moves: block id lists -> runs of consecutive blocks.

A block is one contiguous region of the pool, so blocks that are consecutive
on *both* sides form one region on each side and travel as one descriptor:

    remote ids  [7, 8, 9, 3, 4]     local ids  [0, 1, 2, 5, 9]
    runs        (7->0, 3 blocks)  (3->5, 1 block)  (4->9, 1 block)

All functions here are pure and cheap; the backends turn runs into NIXL
descriptors or socket reads."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockRun:
    remote_start: int
    local_start: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.remote_start < 0 or self.local_start < 0:
            raise ValueError(f"invalid block run {self}")


def as_block_ids(block_ids: Iterable[int]) -> list[int]:
    """A list of Python ints from a list, tuple, numpy array or 1-D tensor of ids;
    floats and other non-integers raise TypeError."""
    if hasattr(block_ids, "tolist"):
        block_ids = block_ids.tolist()
    return [operator.index(b) for b in block_ids]


def local_ids_of(runs: Iterable[BlockRun]) -> tuple[int, ...]:
    """The puller's block ids the runs cover, in order."""
    return tuple(r.local_start + i for r in runs for i in range(r.num_blocks))


def remote_ids_of(runs: Iterable[BlockRun]) -> tuple[int, ...]:
    """The owner's block ids the runs cover, in order."""
    return tuple(r.remote_start + i for r in runs for i in range(r.num_blocks))


def coalesce_block_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[BlockRun]:
    """Groups pairs (remote_block_ids[i], local_block_ids[i]) into maximal runs
    that are consecutive on both sides, keeping the given order."""
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(f"{len(remote_block_ids)} remote block ids but {len(local_block_ids)} local ones; "
                         "a pull copies remote_block_ids[i] into local_block_ids[i]")
    runs: list[BlockRun] = []
    if not remote_block_ids:
        return runs
    start_r, start_l, n = int(remote_block_ids[0]), int(local_block_ids[0]), 1
    for r, loc in zip(remote_block_ids[1:], local_block_ids[1:]):
        r, loc = int(r), int(loc)
        if r == start_r + n and loc == start_l + n:
            n += 1
            continue
        runs.append(BlockRun(start_r, start_l, n))
        start_r, start_l, n = r, loc, 1
    runs.append(BlockRun(start_r, start_l, n))
    return runs


def split_block_runs(runs: Sequence[BlockRun], max_blocks: int) -> list[BlockRun]:
    """Cuts runs longer than ``max_blocks`` (bounds staging buffers)."""
    if max_blocks <= 0:
        raise ValueError(f"max_blocks must be > 0, got {max_blocks}")
    out: list[BlockRun] = []
    for run in runs:
        for offset in range(0, run.num_blocks, max_blocks):
            n = min(max_blocks, run.num_blocks - offset)
            out.append(BlockRun(run.remote_start + offset, run.local_start + offset, n))
    return out


def check_block_ids(remote_block_ids: Sequence[int], local_block_ids: Sequence[int],
                    remote_num_blocks: int, local_num_blocks: int) -> None:
    """Raises ValueError for ids out of range, unequal lengths, or a local block
    named twice (two remote blocks cannot land in one place)."""
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(f"{len(remote_block_ids)} remote block ids but {len(local_block_ids)} local ones; "
                         "a pull copies remote_block_ids[i] into local_block_ids[i]")
    _check_range("remote", remote_block_ids, remote_num_blocks)
    _check_range("local", local_block_ids, local_num_blocks)
    if len(set(local_block_ids)) != len(local_block_ids):
        seen: set[int] = set()
        dup = next(b for b in local_block_ids if b in seen or seen.add(b))
        raise ValueError(f"local block {dup} appears twice in one pull; each local block receives one remote block")


def _check_range(side: str, block_ids: Sequence[int], num_blocks: int) -> None:
    for b in block_ids:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_blocks:
            raise ValueError(f"{side} block id {b!r} is outside the {side} pool's 0..{num_blocks - 1}")


def runs_to_regions(runs: Sequence[BlockRun], base_addr: int, block_bytes: int,
                    side: str) -> list[tuple[int, int]]:
    """(address, length) of each run on one side ("remote" or "local")."""
    if side not in ("remote", "local"):
        raise ValueError(f"side must be 'remote' or 'local', got {side!r}")
    key = "remote_start" if side == "remote" else "local_start"
    return [(base_addr + getattr(run, key) * block_bytes, run.num_blocks * block_bytes) for run in runs]


def descriptor_array(regions: list[tuple[int, int]], device_id: int) -> np.ndarray:
    """NIXL's Nx3 (address, length, device id) descriptor list of ``regions``."""
    out = np.empty((len(regions), 3), dtype=np.uint64)
    for i, (addr, length) in enumerate(regions):
        out[i] = (addr, length, device_id)
    return out
