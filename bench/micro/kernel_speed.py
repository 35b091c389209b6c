"""Kernel microbenchmarks at SmolLM2-135M shapes (hidden 576, 9 q heads,
3 kv heads, head dim 64, 30 layers, block size 16, bf16).

On the CPU it times each op through ``pdcluster.kernels.ops`` (the native kernels the
CPU engine runs: the AVX-512 BF16 or the AVX2 variant, whichever this CPU
has) and the torch reference, and compares each op's achieved bandwidth with
a plain ``copy_`` measured in the same run; then the linear layers (torch
bf16, torch fp32 on upcast weights, ours) at decode and prefill row counts.
On CUDA it times each Triton kernel (through ``pdcluster.kernels.ops``) and the torch
reference on the same GPU, and compares the kernel's bandwidth with
the GPU's peak HBM bandwidth.  Bandwidth counts the bytes an op must move at
least (inputs read once, outputs written once), not what an implementation
happens to copy.

On the CPU it ends with issue 34's targets: our linear against torch's
oneDNN bf16 linear at prefill row counts, and a lone 3k-token prompt's
prefill on the default prefill engine against its FLOPs at the
fingerprint's GEMM rate (bench/micro/lone_prompt.py).

    .venv/bin/python -m bench.micro.kernel_speed [--device cpu|cuda] [--threads N] [--min-time-s 0.2] [--prefill-only]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import torch

from bench.fingerprint import print_fingerprint
from bench.micro import lone_prompt
from bench.targets import print_target
from pdcluster.kernels import ops
from pdcluster.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
from pdcluster.kernels.kv_write import write_kv_ref
from pdcluster.kernels.paged_decode_attention import paged_decode_attention_ref
from pdcluster.kernels.prefill_attention import prefill_attention_ref
from pdcluster.kernels.rmsnorm import fused_add_rmsnorm_ref, rmsnorm_ref
from pdcluster.kernels.rope import apply_rope_ref, rope_cos_sin

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK_SIZE = 576, 9, 3, 64, 30, 16
DTYPE = torch.bfloat16
ELT = 2  # bytes per bf16
DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_TOKENS = (1, 16, 64), (256, 1024, 2048), (256, 1024)
DECODE_TARGET = (64, 2048, 0.60)  # batch, context, fraction of peak HBM
LINEAR_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # name: (N, K)
LINEAR_ROWS = (1, 16, 256, 1024, 3072)  # decode batch 1 and 16, prefill chunks
PREFILL_TARGET_ROWS = (256, 1024, 3072)  # issue 34: ours >= torch's oneDNN bf16 linear at these row counts
LONE_PROMPT_TOKENS, LONE_PROMPT_GOAL = 3072, 1.5  # issue 34: a lone prompt's prefill within 1.5x FLOPs / GEMM rate
PREFILL_FIGURE_ROWS = 1024  # the prompt length the prefill linear and attention figures are quoted at
COMMAND = ".venv/bin/python -m bench.micro.kernel_speed"


@dataclass
class Case:
    name: str
    bytes_moved: int
    ref: Callable[[], object]
    fast: Callable[[], object]  # pdcluster.kernels.ops: Triton on CUDA, the native kernels on the CPU
    flops: int = 0


def _time_s(fn: Callable[[], object], device: torch.device, min_time_s: float) -> float:
    """Seconds per call: the median on CUDA (events), the best of several
    calls on the CPU (robust to other processes sharing the cores)."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=max(100, int(min_time_s * 1e3)),
                                       return_mode="median") / 1e3
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time_s and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _make_pool(num_blocks: int, device: torch.device) -> torch.Tensor:
    pool = torch.empty((num_blocks, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=DTYPE, device=device)
    if device.type == "cuda":
        pool.normal_()
    else:  # touch only what the cases read: layer 0 everywhere (pages stay lazy elsewhere)
        pool[:, 0].normal_()
    return pool


def decode_cases(pool: torch.Tensor) -> list[Case]:
    cases, dev = [], pool.device
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            nb = ctx // BLOCK_SIZE
            tables = torch.randperm(pool.shape[0], device=dev)[:batch * nb].view(batch, nb).int()
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
            args = (q, pool, 0, tables, lens, HEAD_DIM ** -0.5)
            moved = batch * ctx * KV_HEADS * HEAD_DIM * 2 * ELT + 2 * q.numel() * ELT
            cases.append(Case(f"paged_decode_attention b={batch} ctx={ctx}", moved,
                              lambda a=args: paged_decode_attention_ref(*a),
                              lambda a=args: ops.paged_decode_attention(*a)))
    return cases


def prefill_cases(pool: torch.Tensor) -> list[Case]:
    cases, dev = [], pool.device
    for n in PREFILL_TOKENS:
        nb = n // BLOCK_SIZE
        tables = torch.randperm(pool.shape[0], device=dev)[:nb].view(1, nb).int()
        qsl = torch.tensor([0, n], dtype=torch.int32, device=dev)
        lens = torch.tensor([n], dtype=torch.int32, device=dev)
        q = torch.randn(n, HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
        args = (q, pool, 0, tables, qsl, lens, HEAD_DIM ** -0.5)
        moved = n * KV_HEADS * HEAD_DIM * 2 * ELT + 2 * q.numel() * ELT
        flops = 2 * 2 * HEADS * HEAD_DIM * n * (n + 1) // 2  # QK^T and PV, causal half
        cases.append(Case(f"prefill_attention tokens={n}", moved,
                          lambda a=args: prefill_attention_ref(*a),
                          lambda a=args: ops.prefill_attention(*a), flops))
    return cases


def prefill_attention_vs_sdpa(pool: torch.Tensor, min_time_s: float) -> None:
    """Prefill attention of one fresh PREFILL_FIGURE_ROWS-token prompt (causal,
    GQA): ``ops.prefill_attention`` over the paged pool next to torch's
    ``scaled_dot_product_attention`` on dense q/k/v (its CPU flash attention;
    it cannot read the pool, so it gets the dense copy for free)."""
    n, dev = PREFILL_FIGURE_ROWS, pool.device
    nb = n // BLOCK_SIZE
    tables = torch.randperm(pool.shape[0], device=dev)[:nb].view(1, nb).int()
    qsl = torch.tensor([0, n], dtype=torch.int32, device=dev)
    lens = torch.tensor([n], dtype=torch.int32, device=dev)
    q = torch.randn(n, HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    k, v = (torch.randn(1, KV_HEADS, n, HEAD_DIM, dtype=DTYPE, device=dev) for _ in range(2))
    qt = q.transpose(0, 1).unsqueeze(0)
    ours_s = _time_s(lambda: ops.prefill_attention(q, pool, 0, tables, qsl, lens, HEAD_DIM ** -0.5), dev, min_time_s)
    sdpa_s = _time_s(lambda: torch.nn.functional.scaled_dot_product_attention(qt, k, v, is_causal=True,
                                                                               enable_gqa=True), dev, min_time_s)
    flop = 2 * 2 * HEADS * HEAD_DIM * n * (n + 1) // 2
    print(f"prefill attention at {n} tokens ({HEADS} q / {KV_HEADS} kv heads, causal, {torch.get_num_threads()} "
          f"threads): ours {flop / ours_s / 1e12:.2f} TFLOP/s ({ours_s * 1e3:.2f} ms), torch sdpa "
          f"{flop / sdpa_s / 1e12:.2f} TFLOP/s ({sdpa_s * 1e3:.2f} ms)")


def elementwise_cases(pool: torch.Tensor) -> list[Case]:
    # a decode step of 64 sequences; a prefill chunk of 1024 tokens
    return [case for t in (64, 1024) for case in _token_cases(pool, t)]


def _token_cases(pool: torch.Tensor, t: int) -> list[Case]:
    dev = pool.device
    k = torch.randn(t, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    slots = (torch.randperm(pool.shape[0], device=dev)[:t] * BLOCK_SIZE).long()
    x, res = (torch.randn(t, HIDDEN, dtype=DTYPE, device=dev) for _ in range(2))
    w = torch.randn(HIDDEN, dtype=DTYPE, device=dev)
    q = torch.randn(t, HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    kr = torch.randn(t, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    cos, sin = (c.to(dev) for c in rope_cos_sin(HEAD_DIM, 8192, 100000.0))
    pos = torch.randint(0, 8192, (t,), device=dev)
    return [
        Case(f"write_kv tokens={t}", 2 * 2 * k.numel() * ELT,
             lambda: write_kv_ref(pool, 0, k, k, slots), lambda: ops.write_kv(pool, 0, k, k, slots)),
        Case(f"rmsnorm tokens={t}", 2 * x.numel() * ELT + w.numel() * ELT,
             lambda: rmsnorm_ref(x, w, 1e-5), lambda: ops.rmsnorm(x, w, 1e-5)),
        Case(f"fused_add_rmsnorm tokens={t}", 4 * x.numel() * ELT + w.numel() * ELT,
             lambda: fused_add_rmsnorm_ref(x, res, w, 1e-5), lambda: ops.fused_add_rmsnorm(x, res, w, 1e-5)),
        Case(f"rope tokens={t}", 2 * (q.numel() + kr.numel()) * ELT + 2 * t * HEAD_DIM * 4,
             lambda: apply_rope_ref(q, kr, pos, cos, sin), lambda: ops.apply_rope(q, kr, pos, cos, sin)),
    ]


def block_copy_cases(pool: torch.Tensor) -> list[Case]:
    ids = torch.randperm(pool.shape[0], device=pool.device)[:64]
    pool[ids] = torch.randn(pool[ids].shape, dtype=DTYPE, device=pool.device)
    buffer = gather_blocks_ref(pool, ids)
    moved = 2 * buffer.numel() * ELT
    return [
        Case("gather_blocks n=64", moved, lambda: gather_blocks_ref(pool, ids), lambda: ops.gather_blocks(pool, ids)),
        Case("scatter_blocks n=64", moved, lambda: scatter_blocks_ref(pool, ids, buffer),
             lambda: ops.scatter_blocks(pool, ids, buffer)),
    ]


def linear_table(min_time_s: float, copy_peak: float) -> dict[int, float]:
    """The projections of one layer at decode and prefill row counts: the
    torch bf16 linear (oneDNN; on AMX CPUs its tile kernels), torch fp32 on an
    upcast copy of the weights (x upcast and y rounded per call), and
    ``ops.linear`` on packed weights (path: "amx" tiles or "dot" vector dot
    products, ``cpu_native.linear_path``); weight GB/s against copy_ tells how
    close a decode GEMV is to its bandwidth floor.  Ends with the prefill
    figure the AMX work is judged by: TFLOP/s of the layer's projections at
    PREFILL_FIGURE_ROWS tokens, ours next to torch bf16's.  Returns, per row
    count, torch bf16's time over ours summed over the layer's projections."""
    cpu = torch.device("cpu")
    per_rows: dict[int, list[float]] = {}
    print(f"linear (y = x W^T, bf16; {ops.native_variant() or 'no native'} kernels vs torch):")
    print(f"{'shape M x K -> N':<28}{'torch bf16':>11}{'torch fp32':>11}{'ours ms':>9}{'path':>6}{'vs bf16':>9}"
          f"{'vs fp32':>9}{'GFLOP/s':>9}{'torch':>8}{'W GB/s':>8}{'of copy_':>9}")
    prefill = {"ours": 0.0, "torch": 0.0, "flop": 0.0}
    for m in LINEAR_ROWS:
        for name, (n, k) in LINEAR_SHAPES.items():
            x = torch.randn(m, k, dtype=DTYPE)
            w = torch.randn(n, k, dtype=DTYPE) * k ** -0.5
            w32, packed = w.float(), ops.pack_linear_weight(w)
            bf16_s = _time_s(lambda: torch.nn.functional.linear(x, w), cpu, min_time_s)
            fp32_s = _time_s(lambda: torch.nn.functional.linear(x.float(), w32).to(DTYPE), cpu, min_time_s)
            ours_s = _time_s(lambda: ops.linear(x, packed), cpu, min_time_s)
            w_gbs, flop = n * k * ELT / ours_s / 1e9, 2 * m * n * k
            path = ops.linear_path(m, n, k)
            per_rows.setdefault(m, [0.0, 0.0])
            per_rows[m][0] += bf16_s
            per_rows[m][1] += ours_s
            print(f"{name + f' {m} x {k} -> {n}':<28}{bf16_s * 1e3:>11.3f}{fp32_s * 1e3:>11.3f}{ours_s * 1e3:>9.3f}"
                  f"{path:>6}{bf16_s / ours_s:>8.2f}x{fp32_s / ours_s:>8.2f}x{flop / ours_s / 1e9:>9.1f}"
                  f"{flop / bf16_s / 1e9:>8.1f}{w_gbs:>8.1f}{w_gbs / copy_peak:>9.0%}", flush=True)
            if m == PREFILL_FIGURE_ROWS:
                prefill["ours"] += ours_s
                prefill["torch"] += bf16_s
                prefill["flop"] += flop
    if prefill["flop"]:
        ours, theirs = prefill["flop"] / prefill["ours"] / 1e12, prefill["flop"] / prefill["torch"] / 1e12
        print(f"prefill linear at {PREFILL_FIGURE_ROWS} tokens ({' + '.join(LINEAR_SHAPES)}, {torch.get_num_threads()} "
              f"threads): ours {ours:.2f} TFLOP/s, torch bf16 {theirs:.2f} TFLOP/s ({ours / theirs:.2f}x)")
    return {m: torch_s / ours_s for m, (torch_s, ours_s) in per_rows.items()}


def copy_gbps(device: torch.device, min_time_s: float) -> float:
    """A plain ``copy_`` of 256 MiB (more than any cache): what this device
    streams in practice.  Ops whose working set fits in cache can beat it."""
    src = torch.randn(64 * 2**20, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _time_s(lambda: dst.copy_(src), device, min_time_s) / 1e9


def peak_hbm_gbps(device: torch.device) -> tuple[float, str]:
    import triton.testing
    try:
        return triton.testing.get_dram_gbps(device.index or 0), "memory clock x bus width (driver)"
    except Exception as err:  # noqa: BLE001 - report and fall back to a measured figure
        return copy_gbps(device, 0.2), f"measured copy_ (driver query failed: {err})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--min-time-s", type=float, default=0.2, help="time each op at least this long")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--prefill-only", action="store_true",
                        help="CPU: only the linear table and the prefill attention figure")
    args = parser.parse_args(argv)
    fp = print_fingerprint()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    print(f"command: {COMMAND} --device {device.type}" + (f" --threads {args.threads}" if args.threads else "")
          + (" --prefill-only" if args.prefill_only else ""))
    max_blocks = max(DECODE_BATCHES) * max(DECODE_CONTEXTS) // BLOCK_SIZE + 64
    pool = _make_pool(max_blocks, device)
    if on_gpu:
        peak, source = peak_hbm_gbps(device)
        print(f"device: {torch.cuda.get_device_name(device)}; peak HBM {peak:.0f} GB/s ({source})")
        print("compares: each Triton kernel (pdcluster.kernels.ops on CUDA) with the torch reference on the same GPU, "
              "and its bandwidth with peak HBM")
    else:
        peak = copy_gbps(device, args.min_time_s)
        print(f"device: CPU, {torch.get_num_threads()} torch threads; plain copy_ {peak:.1f} GB/s (this run)")
        print(f"compares: each op through pdcluster.kernels.ops (native kernels: {ops.native_variant() or 'none'}) "
              "with the torch reference, and its bandwidth with copy_")
    print(f"shapes: SmolLM2-135M, {HEADS} q / {KV_HEADS} kv heads, head dim {HEAD_DIM}, {LAYERS} layers, "
          f"block size {BLOCK_SIZE}, {DTYPE}; bandwidth = minimum bytes moved / time")
    if not (args.prefill_only and not on_gpu):
        cases = decode_cases(pool) + prefill_cases(pool) + elementwise_cases(pool) + block_copy_cases(pool)
        print_targets(run_cases(cases, device, on_gpu, peak, args.min_time_s), on_gpu, peak)
    if not on_gpu:
        vs_torch = linear_table(args.min_time_s, peak)
        prefill_attention_vs_sdpa(pool, args.min_time_s)
        lone = lone_prompt.measure(LONE_PROMPT_TOKENS)
        rate = max(fp.torch_bf16_gemm_tflops, fp.ours_bf16_gemm_tflops)
        print(f"lone prompt: {lone.tokens} tokens in {lone.seconds:.2f} s on {lone.threads} threads "
              f"(the engine a bare `pdcluster up` prefills with here: the {lone.layout} layout's, idle host); "
              f"{lone.flops / 1e12:.2f} TFLOP at the fingerprint's best GEMM rate {rate * 1e3:.1f} GFLOP/s "
              f"= {lone.flops / (rate * 1e12):.2f} s")
        for m in PREFILL_TARGET_ROWS:
            print_target(f"prefill_linear_vs_onednn_m{m}", vs_torch[m], ">=", 1.0)
        print_target(f"lone_{LONE_PROMPT_TOKENS}_token_prefill_vs_flops_at_gemm_rate", lone.ratio(rate), "<=",
                     LONE_PROMPT_GOAL)


def run_cases(cases: list[Case], device: torch.device, on_gpu: bool, peak: float,
              min_time_s: float) -> dict[str, float]:
    """Prints one row per case; returns the measured GB/s by case name."""
    fast_name = "triton ms" if on_gpu else ("native ms" if ops.native_variant() is not None else "ops ms")
    head = f"{'op':<38}{'torch ms':>10}{fast_name:>11}{'speedup':>9}"
    print(head + f"{'GB/s':>9}{'of peak' if on_gpu else 'of copy_':>10}{'TFLOP/s':>9}")
    gbps: dict[str, float] = {}
    for case in cases:
        ref_s = _time_s(case.ref, device, min_time_s)
        fast_s = _time_s(case.fast, device, min_time_s)
        gbps[case.name] = case.bytes_moved / fast_s / 1e9
        row = f"{case.name:<38}{ref_s * 1e3:>10.3f}{fast_s * 1e3:>11.3f}{ref_s / fast_s:>8.2f}x"
        tflops = f"{case.flops / fast_s / 1e12:>9.3f}" if case.flops else f"{'':>9}"
        print(row + f"{gbps[case.name]:>9.1f}{gbps[case.name] / peak:>9.0%}" + tflops, flush=True)
    return gbps


def print_targets(gbps: dict[str, float], on_gpu: bool, peak: float) -> None:
    batch, ctx, goal = DECODE_TARGET
    name = f"paged_decode_attention b={batch} ctx={ctx}"
    if not on_gpu:
        print(f"GPU target paged_decode_attention (>= {goal:.0%} of peak HBM at batch {batch}, context {ctx}): "
              "not measured (no GPU on this machine)")
        return
    fraction = gbps[name] / peak
    print(f"target paged_decode_attention_b{batch}_ctx{ctx}_hbm_fraction: {fraction:.2f} "
          f"(goal >= {goal:.2f}) {'met' if fraction >= goal else 'missed'}")


if __name__ == "__main__":
    main()
