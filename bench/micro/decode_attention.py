"""Paged decode attention as a decode step runs it: every layer in turn over a
batch's blocks scattered through a serving-sized KV pool, so each layer's K
and V come from DRAM, against the same calls over blocks that stay in cache.

kernel_speed.py times one layer's call again and again (its KV then sits in
the last-level cache); a decode step reads each layer's KV once, 6 KiB per
block and layer for the default model, 368 KiB apart.  The gap between the
two rows here is what memory costs the kernel.

    python -m bench.micro.decode_attention [--threads 2] [--variant NAME]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from bench.fingerprint import print_fingerprint

LAYERS, BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 30, 16, 9, 3, 64  # SmolLM2-135M
POOL_BLOCKS = 2048  # 750 MB of bf16 KV, about what a serving replica holds
CASES = ((16, 320), (16, 1024), (4, 2048), (1, 2048))  # (sequences, context tokens)
COMMAND = ".venv/bin/python -m bench.micro.decode_attention"


def kv_bytes(batch: int, ctx: int) -> int:
    """K and V bytes one decode step's attention reads over every layer (pure)."""
    return batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS


def step_ms(pool: torch.Tensor, tables: torch.Tensor, batch: int, ctx: int, repeats: int = 10) -> float:
    """Median ms of one step's calls, every layer once, over ``tables``'s blocks."""
    from pdcluster.kernels import ops

    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16)

    def once() -> None:
        for layer in range(LAYERS):
            ops.paged_decode_attention(q, pool, layer, tables, lens, HEAD_DIM ** -0.5)

    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def threads_arg(text: str) -> int:
    """--threads: a whole number of threads, at least 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--threads must be a whole number >= 1, got {text!r}")
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=threads_arg, default=2)
    ap.add_argument("--variant", help="native kernel variant to load (PDCLUSTER_CPU_KERNELS), e.g. avx2")
    args = ap.parse_args(argv)
    if args.variant:
        os.environ["PDCLUSTER_CPU_KERNELS"] = args.variant
    from pdcluster.kernels import ops

    print_fingerprint()
    torch.set_num_threads(args.threads)
    ops.set_native_threads(args.threads)
    print(f"command: {COMMAND} --threads {args.threads}" + (f" --variant {args.variant}" if args.variant else ""))
    print(f"compares: the native paged decode attention (variant {ops.native_variant() or 'none'}), {LAYERS} layers "
          f"per step, blocks scattered in a {POOL_BLOCKS}-block pool (DRAM) against the same blocks for every "
          f"sequence (cache); {HEADS} q / {KV_HEADS} kv heads, head dim {HEAD_DIM}, block {BLOCK_SIZE}, bf16")
    pool = torch.randn(POOL_BLOCKS, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    print(f"{'sequences x context':>20} | {'DRAM ms':>8} {'GB/s':>6} | {'cache ms':>8} {'GB/s':>6}")
    for batch, ctx in CASES:
        print(f"... {batch} x {ctx}", file=sys.stderr, flush=True)
        nb = -(-ctx // BLOCK_SIZE)
        scattered = torch.randperm(POOL_BLOCKS)[:batch * nb].view(batch, nb).int()
        shared = torch.arange(nb).repeat(batch, 1).int()
        dram, hot = step_ms(pool, scattered, batch, ctx), step_ms(pool, shared, batch, ctx)
        moved = kv_bytes(batch, ctx)
        print(f"{f'{batch} x {ctx}':>20} | {dram:8.2f} {moved / dram / 1e6:6.1f} | {hot:8.2f} {moved / hot / 1e6:6.1f}")


if __name__ == "__main__":
    main()
