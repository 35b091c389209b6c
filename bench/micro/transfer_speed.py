"""KV transfer benchmark: each backend pulling SmolLM2-sized KV blocks from an
owner process, beside a single-thread memcpy (tensor.copy_) of the same bytes
measured in the same run.

    python -m bench.micro.transfer_speed                      # the full table (~1 min, ~4.5 GB of RAM)
    python -m bench.micro.transfer_speed --sizes 1,16,64 --backends nixl
    python -m bench.micro.transfer_speed --backends nixl,fallback,nixl-write   # NIXL's READ (default here) vs the owner's WRITE
    python -m bench.micro.transfer_speed --two-hosts          # over a veth between two network namespaces (root)

Block lists are fragmented the way a busy pool is (runs of 1..32 consecutive
blocks in random order on both sides); the descriptor column shows how many
descriptors coalescing leaves of one per block.  "nixl 1-run" pulls the same
bytes as one consecutive run.  Times are medians of interleaved repetitions,
measured around the whole pull() call (id handling, notification included).
Both sides hold a cluster secret, as the serving layer's do (signed
descriptors, tagged notifications, authenticated connections); --no-secret
measures without."""

from __future__ import annotations

import argparse
import os
import sys
import multiprocessing as mp
import random
import secrets

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import torch

from bench.fingerprint import print_fingerprint
from bench.micro.transfer_cases import SMOLLM2, bench_backend, fill_pattern, measure_size, reps_for
from pdcluster.transfer import TransferBackend, allocate_kv_pool

OVERHEAD_GOAL_MS = 1.0
MEMCPY_RATIO_GOAL = 0.8
RATIO_FROM_BLOCKS = 64
DEFAULT_SIZES = "1,16,64,256,4096"
TWO_HOSTS_SIZES = "16,64,256"


def owner_main(conn, backends: list[str], pool_blocks: int, secret: bytes | None) -> None:
    torch.set_num_threads(1)
    pool = allocate_kv_pool(pool_blocks, SMOLLM2)
    fill_pattern(pool)
    owners: dict[str, TransferBackend] = {}
    for name in backends:
        owners[name] = bench_backend(name, peer_id=f"bench-owner-{name}", secret=secret)
        owners[name].register_pool(pool, SMOLLM2)
    conn.send({name: b.describe() for name, b in owners.items()})
    while not conn.poll(0.005):
        for backend in owners.values():
            backend.poll_notifications()  # what a prefill replica does between steps
    for backend in owners.values():
        backend.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="block counts per pull")
    parser.add_argument("--backends", default="nixl,fallback",
                        help="columns: nixl (its default pull mode), fallback, nixl-read, nixl-write")
    parser.add_argument("--reps-scale", type=float, default=1.0, help="multiply repetitions (noise vs time)")
    parser.add_argument("--no-secret", action="store_true", help="run without the cluster secret (no authentication)")
    parser.add_argument("--two-hosts", action="store_true",
                        help="between two network namespaces over a veth pair, next to loopback (root; "
                             "bench/micro/transfer_two_hosts.py)")
    parser.add_argument("--pool-blocks", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--_owner", metavar="HOST", help=argparse.SUPPRESS)
    parser.add_argument("--_pull", nargs=3, metavar=("HOST", "OWNER_NS", "OWNER_HOST"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.two_hosts or args._owner or args._pull:
        return two_hosts_mode(args)
    print_fingerprint()
    secret = None if args.no_secret else secrets.token_bytes(32)  # one bench run = one cluster
    sizes = [int(s) for s in args.sizes.split(",")]
    backends = args.backends.split(",")
    columns = [*backends, *(["nixl 1-run"] if "nixl" in backends else [])]
    torch.set_num_threads(1)
    pool_blocks = max(max(sizes), 1024)  # 360 MiB or more: well past the last-level cache
    print_header(args, pool_blocks)

    print("  [1/3] starting the owner process and filling its pool ...", flush=True)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    owner = ctx.Process(target=owner_main, args=(child, backends, pool_blocks, secret), daemon=True)
    owner.start()
    pool = allocate_kv_pool(pool_blocks, SMOLLM2)  # 2 MiB pages, as the engine's pool should be
    memcpy_src = allocate_kv_pool(pool_blocks, SMOLLM2)
    memcpy_src.fill_(1.0)
    pullers = {name: bench_backend(name, peer_id=f"bench-puller-{name}", timeout_s=60.0, secret=secret)
               for name in backends}
    for backend in pullers.values():
        backend.register_pool(pool, SMOLLM2)
    if not conn.poll(300):
        raise SystemExit("owner process did not start within 300 s")
    descriptors = conn.recv()

    print("  [2/3] warm-up: handshakes and one full pull per backend (faults every page in) ...", flush=True)
    everything = list(range(pool_blocks))
    for name, backend in pullers.items():
        backend.pull(descriptors[name], everything, everything)
    pool.copy_(memcpy_src)

    print("  [3/3] measuring; GB/s = 1e9 bytes/s of median pull time, (x memcpy) = memcpy time / pull time\n")
    print(f"{'blocks':>6} {'MiB':>7} {'descriptors':>17} {'memcpy GB/s':>11}  "
          + "  ".join(f"{c + ' GB/s (x memcpy) time':>34}" for c in columns), flush=True)
    rng = random.Random(0)
    rows = {}
    for n in sizes:
        rows[n] = measure_size(n, pullers, descriptors, pool, memcpy_src, rng, reps_for(n, args.reps_scale))
        print_row(n, rows[n], columns)
    conn.send("stop")
    owner.join(30)
    for backend in pullers.values():
        backend.close()
    print_targets(rows, backends)
    return 0


def two_hosts_mode(args: argparse.Namespace) -> int:
    from bench.micro import transfer_two_hosts as two
    sizes = [int(s) for s in (args.sizes if args.sizes != DEFAULT_SIZES else TWO_HOSTS_SIZES).split(",")]
    backends = args.backends.split(",")
    if args._owner:
        return two.owner_stdio(args._owner, backends, args.pool_blocks)
    if args._pull:
        return two.puller_stdio(*args._pull, backends, sizes, args.pool_blocks, args.reps_scale)
    return two.run(sizes, backends, args.reps_scale)


def print_header(args: argparse.Namespace, pool_blocks: int) -> None:
    print("KV transfer: pull from a second process vs single-thread memcpy (tensor.copy_) of the same bytes")
    print(f"  blocks: SmolLM2 layout {SMOLLM2.block_shape} bf16 = {SMOLLM2.block_bytes:,} B; pools of "
          f"{pool_blocks} blocks ({pool_blocks * SMOLLM2.block_bytes / 2**20:,.0f} MiB) in each process on "
          "2 MiB pages (transfer.allocate_kv_pool)")
    print("  block lists: runs of 1..32 blocks in random order on both sides; descriptors = one per block -> "
          "after coalescing; 'nixl 1-run' = the same bytes as one consecutive run")
    print(f"  host: {os.cpu_count()} CPUs (shared), torch threads 1, UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES')}")
    print("  authentication: " + ("none (--no-secret)" if args.no_secret else
                                  "cluster secret on both sides (signed descriptor, tagged notifications)"))
    print(f"  reproduce: python -m bench.micro.transfer_speed --sizes {args.sizes} --backends {args.backends} "
          f"--reps-scale {args.reps_scale:g}" + (" --no-secret" if args.no_secret else ""))


def print_row(n: int, r: dict[str, float], columns: list[str]) -> None:
    nbytes = n * SMOLLM2.block_bytes
    cells = [f"{nbytes / r[c] / 1e9:>6.2f} ({r['memcpy'] / r[c]:.2f}x) {r[c] * 1e3:>9.3f} ms" for c in columns]
    print(f"{n:>6} {nbytes / 2**20:>7.1f} {r['descs_raw']:>7} -> {r['descs_coalesced']:>6.0f} "
          f"{nbytes / r['memcpy'] / 1e9:>11.2f}  " + "  ".join(f"{c:>34}" for c in cells), flush=True)


def print_targets(rows: dict[int, dict[str, float]], backends: list[str]) -> None:
    """Context first, then exactly one line per target, last."""
    big = [n for n in rows if n >= RATIO_FROM_BLOCKS]
    ratio = min((rows[n]["memcpy"] / rows[n]["nixl"] for n in big), default=None) if "nixl" in backends else None
    overhead_ms = rows[1]["nixl"] * 1e3 if "nixl" in backends and 1 in rows else None
    print()
    if ratio is not None:
        worst = min(big, key=lambda n: rows[n]["memcpy"] / rows[n]["nixl"])
        print(f"  nixl vs memcpy from {RATIO_FROM_BLOCKS} blocks up: worst at {worst} blocks (fragmented lists)")
    for name in backends:
        if 1 in rows:
            print(f"  1-block pull latency, {name}: {rows[1][name] * 1e3:.3f} ms")
    print(f"target nixl_vs_memcpy_from_{RATIO_FROM_BLOCKS}_blocks: "
          + (f"{ratio:.2f}x" if ratio is not None else "not measured")
          + f" (goal >= {MEMCPY_RATIO_GOAL}x) " + ("met" if ratio is not None and ratio >= MEMCPY_RATIO_GOAL else "missed"))
    print("target per_pull_overhead_nixl: "
          + (f"{overhead_ms:.3f} ms" if overhead_ms is not None else "not measured")
          + f" (goal <= {OVERHEAD_GOAL_MS:g} ms) "
          + ("met" if overhead_ms is not None and overhead_ms <= OVERHEAD_GOAL_MS else "missed"))


if __name__ == "__main__":
    sys.exit(main())
