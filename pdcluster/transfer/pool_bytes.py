"""The raw bytes of whole blocks of a block-major pool, for transports that
move bytes through the CPU (the socket fallback).

Host pools are read and written in place through a memoryview: no copy in
Python.  Accelerator pools go through a host staging copy of at most
``max_stage_bytes`` at a time (runs are cut to fit, see split_block_runs)."""

from __future__ import annotations

import torch

from pdcluster.transfer.runs import BlockRun, split_block_runs


class PoolBytes:
    def __init__(self, kv_pool: torch.Tensor, block_bytes: int, max_stage_bytes: int = 64 << 20,
                 staged: bool | None = None) -> None:
        """``staged=None`` stages exactly the pools not on the host (tests force True)."""
        if not kv_pool.is_contiguous():
            raise ValueError("kv_pool must be contiguous")
        self.kv_pool = kv_pool
        self.block_bytes = block_bytes
        self.num_blocks = kv_pool.shape[0]
        self.on_host = kv_pool.device.type == "cpu" and not staged
        self.max_chunk_blocks = self.num_blocks if self.on_host else max(1, max_stage_bytes // block_bytes)
        self._bytes = memoryview(kv_pool.view(torch.uint8).reshape(-1).numpy()) if self.on_host else None

    def chunks(self, runs: list[BlockRun]) -> list[BlockRun]:
        """Runs cut to what one staging buffer holds (unchanged for host pools)."""
        return list(runs) if self.on_host else split_block_runs(runs, self.max_chunk_blocks)

    def read(self, start: int, num_blocks: int) -> memoryview:
        """Bytes of blocks start..start+num_blocks-1 (a live view for host pools)."""
        if self._bytes is not None:
            return self._bytes[start * self.block_bytes:(start + num_blocks) * self.block_bytes]
        staged = self.kv_pool[start:start + num_blocks].to("cpu")
        return memoryview(staged.view(torch.uint8).reshape(-1).numpy())

    def write_buffer(self, start: int, num_blocks: int) -> memoryview:
        """Where the bytes of those blocks should be received; pass it to commit() once full."""
        if self._bytes is not None:
            return self._bytes[start * self.block_bytes:(start + num_blocks) * self.block_bytes]
        return memoryview(bytearray(num_blocks * self.block_bytes))

    def commit(self, start: int, num_blocks: int, buffer: memoryview) -> None:
        if self._bytes is not None:
            return  # received in place
        host = torch.frombuffer(buffer, dtype=torch.uint8).view(self.kv_pool.dtype)
        self.kv_pool[start:start + num_blocks].copy_(host.view(num_blocks, *self.kv_pool.shape[1:]))
