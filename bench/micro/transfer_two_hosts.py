"""`python -m bench.micro.transfer_speed --two-hosts`: KV pulls between two network
namespaces joined by a veth pair (bench/micro/netns.py) -- NIXL over UCX's TCP
transport and the socket fallback, each over the veth ("two hosts") and over
loopback inside one namespace, measured in the same run.

    orchestrator (this process) ── ip netns exec A ──> puller  (10.213.N.1 | 127.0.0.1)
                                                         │ ip netns exec B|A
                                                         └──> owner (10.213.N.2 | 127.0.0.1), its pool filled

UCX_TLS=tcp on both sides: the namespaces share one kernel, and UCX would
otherwise take shared memory (cma) and never touch the veth.  Each side binds
and advertises its own address (pdcluster.transfer.address); both hold one cluster
secret, as replicas do.  The target is NIXL's bandwidth over the veth
against the socket fallback's over the same veth, at the largest size.

Over UCX's TCP transport a NIXL READ is "software emulation" (UCX_PROTO_INFO=y):
the owner answers with active-message fragments its CPU must progress, two
bounce-buffer copies per byte.  A WRITE is a zero-copy send from the owner, so
"nixl" (pull mode "auto", pdcluster.transfer.pull_mode) asks the owner to WRITE here;
add the column "nixl-read" (--backends nixl,fallback,nixl-read) to measure
the READ beside it in the same run."""

from __future__ import annotations

import base64
import json
import os
import pickle
import random
import secrets
import subprocess
import sys

GOAL_VS_SOCKET = 1.0
SECRET_ENV = "PDCLUSTER_BENCH_SECRET"
SCENARIOS = ("loopback", "two hosts")
DESCRIPTORS = "descriptors: "
RESULTS = "results: "


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench.micro.transfer_speed", *args]


def _env(secret: bytes) -> dict[str, str]:
    env = {**os.environ, SECRET_ENV: secret.hex(), "UCX_TLS": "tcp"}
    env.pop("UCX_NET_DEVICES", None)  # each side takes the device of its own address
    return env


def owner_stdio(host: str, backends: list[str], pool_blocks: int) -> int:
    """Owner side (inside its namespace): fills a pool, serves it on ``host``,
    writes the descriptors as one line, polls notifications until stdin closes."""
    import select

    import torch

    from bench.micro.transfer_cases import SMOLLM2, bench_backend, fill_pattern
    from pdcluster.transfer import allocate_kv_pool

    torch.set_num_threads(1)
    secret = bytes.fromhex(os.environ[SECRET_ENV])
    pool = allocate_kv_pool(pool_blocks, SMOLLM2)
    fill_pattern(pool)
    tick = os.environ.get("PDCLUSTER_BENCH_OWNER_TICK_S")  # experiment: the NIXL owner's progress interval
    owners = {name: bench_backend(name, peer_id=f"bench-owner-{name}", secret=secret, internal_host=host,
                                  **({"progress_interval_s": float(tick)} if tick and name.startswith("nixl") else {}))
              for name in backends}
    for backend in owners.values():
        backend.register_pool(pool, SMOLLM2)
    descriptors = {name: b.describe() for name, b in owners.items()}
    print(DESCRIPTORS + base64.b64encode(pickle.dumps(descriptors)).decode(), flush=True)
    while not select.select([sys.stdin], [], [], 0.005)[0]:
        for backend in owners.values():
            backend.poll_notifications()
    for backend in owners.values():
        backend.close()
    return 0


def _descriptor_line(owner: subprocess.Popen, owner_ns: str) -> str:
    """The owner's descriptors (its other output -- library logs -- skipped)."""
    for line in owner.stdout:
        if line.startswith(DESCRIPTORS):
            return line[len(DESCRIPTORS):].strip()
    raise SystemExit(f"the owner in {owner_ns} exited before describing its pool")


def puller_stdio(host: str, owner_ns: str, owner_host: str, backends: list[str], sizes: list[int],
                 pool_blocks: int, reps_scale: float) -> int:
    """Puller side (inside namespace A): starts the owner in ``owner_ns``,
    measures every size, writes one JSON line of median seconds per case."""
    import torch

    from bench.micro.transfer_cases import SMOLLM2, bench_backend, measure_size, reps_for
    from pdcluster.transfer import allocate_kv_pool

    torch.set_num_threads(1)
    secret = bytes.fromhex(os.environ[SECRET_ENV])
    owner = subprocess.Popen(["ip", "netns", "exec", owner_ns,
                              *_python("--_owner", owner_host, "--backends", ",".join(backends),
                                       "--pool-blocks", str(pool_blocks))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pullers = {name: bench_backend(name, peer_id=f"bench-puller-{name}", timeout_s=60.0, secret=secret,
                                        internal_host=host) for name in backends}
        pool = allocate_kv_pool(pool_blocks, SMOLLM2)
        memcpy_src = allocate_kv_pool(pool_blocks, SMOLLM2)
        memcpy_src.fill_(1.0)
        for backend in pullers.values():
            backend.register_pool(pool, SMOLLM2)
        descriptors = pickle.loads(base64.b64decode(_descriptor_line(owner, owner_ns)))
        everything = list(range(pool_blocks))
        for name, backend in pullers.items():  # warm-up: handshakes, every page faulted in
            backend.pull(descriptors[name], everything, everything)
        pool.copy_(memcpy_src)
        rng = random.Random(0)
        rows = {n: measure_size(n, pullers, descriptors, pool, memcpy_src, rng, reps_for(n, reps_scale))
                for n in sizes}
        for backend in pullers.values():
            backend.close()
    finally:
        owner.stdin.close()
        owner.wait(30)
    print(RESULTS + json.dumps(rows), flush=True)
    return 0


def run(sizes: list[int], backends: list[str], reps_scale: float) -> int:
    """The orchestrator: both scenarios, the table, the target line."""
    from bench.fingerprint import print_fingerprint
    from bench.micro.netns import two_hosts, unavailable_reason
    from bench.targets import print_target
    from bench.micro.transfer_cases import SMOLLM2

    print_fingerprint()
    why_not = unavailable_reason()
    if why_not:
        print(f"two-host mode unavailable: {why_not}")
        print_target("nixl_two_hosts_vs_socket", float("nan"), ">=", GOAL_VS_SOCKET)
        return 1
    pool_blocks = max(max(sizes), 256)
    print("KV transfer between two network namespaces joined by a veth pair (two 'hosts' on one machine), "
          "next to loopback inside one namespace")
    print(f"  blocks: SmolLM2 layout {SMOLLM2.block_shape} bf16 = {SMOLLM2.block_bytes:,} B; pools of "
          f"{pool_blocks} blocks; UCX_TLS=tcp; cluster secret on both sides; fragmented block lists")
    print(f"  reproduce: python -m bench.micro.transfer_speed --two-hosts --sizes {','.join(map(str, sizes))} "
          f"--backends {','.join(backends)} --reps-scale {reps_scale:g}", flush=True)
    secret = secrets.token_bytes(32)
    results: dict[str, dict] = {}
    with two_hosts() as pair:
        for scenario in SCENARIOS:
            owner_ns, owner_host, host = ((pair.ns_a, "127.0.0.1", "127.0.0.1") if scenario == "loopback"
                                          else (pair.ns_b, pair.ip_b, pair.ip_a))
            print(f"  measuring {scenario}: puller {host} <- owner {owner_host} ...", flush=True)
            before = pair.tx_bytes(pair.ns_b, pair.dev_b)
            out = subprocess.run(["ip", "netns", "exec", pair.ns_a,
                                  *_python("--_pull", host, owner_ns, owner_host, "--backends", ",".join(backends),
                                           "--sizes", ",".join(map(str, sizes)), "--pool-blocks", str(pool_blocks),
                                           "--reps-scale", str(reps_scale))],
                                 env=_env(secret), capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                print(out.stdout[-2000:], out.stderr[-4000:], sep="\n")
                raise SystemExit(f"the {scenario} run failed (exit {out.returncode})")
            [line] = [x for x in out.stdout.splitlines() if x.startswith(RESULTS)]
            results[scenario] = {int(k): v for k, v in json.loads(line[len(RESULTS):]).items()}
            results[scenario]["veth_bytes"] = pair.tx_bytes(pair.ns_b, pair.dev_b) - before
    print_table(results, sizes, backends)
    return print_targets(results, sizes, backends)


def print_table(results: dict, sizes: list[int], backends: list[str]) -> None:
    from bench.micro.transfer_cases import SMOLLM2

    print(f"\n{'scenario':<10} {'blocks':>6} {'MiB':>7}  " + "  ".join(f"{b + ' GB/s':>14}" for b in backends)
          + f"  {'memcpy GB/s':>11}")
    for scenario in SCENARIOS:
        for n in sizes:
            r, nbytes = results[scenario][n], n * SMOLLM2.block_bytes
            print(f"{scenario:<10} {n:>6} {nbytes / 2**20:>7.1f}  "
                  + "  ".join(f"{nbytes / r[b] / 1e9:>14.2f}" for b in backends)
                  + f"  {nbytes / r['memcpy'] / 1e9:>11.2f}")
    for scenario in SCENARIOS:
        print(f"  bytes sent by the owner's veth end during the {scenario} run: "
              f"{results[scenario]['veth_bytes'] / 2**20:,.1f} MiB")


def print_targets(results: dict, sizes: list[int], backends: list[str]) -> int:
    from bench.targets import print_target

    n = max(sizes)
    two = results["two hosts"][n]
    if "nixl" in backends and "fallback" in backends:
        ratio = two["fallback"] / two["nixl"]
        print(f"\n  at {n} blocks over the veth: nixl {two['nixl'] * 1e3:.1f} ms, socket {two['fallback'] * 1e3:.1f} ms"
              f" per pull; loopback nixl {results['loopback'][n]['nixl'] * 1e3:.1f} ms")
    else:
        ratio = float("nan")
    print_target("nixl_two_hosts_vs_socket", ratio, ">=", GOAL_VS_SOCKET)
    return 0
