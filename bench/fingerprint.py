"""The machine a benchmark ran on, printed at the top of every bench script:
machines of the same kind differ (one tuned figure measured 3x lower on
another), so two runs can be told apart by what they ran on.

    from bench.fingerprint import print_fingerprint
    print_fingerprint()          # a few lines starting "machine:"

CPU model, cores torch uses, the ISA flags that decide our kernels
(avx512f, avx512_bf16, amx_bf16, amx_tile), memory, and two quick
measurements (under a second each): single-thread copy bandwidth
(tensor.copy_ of 256 MiB) and bf16 GEMM through torch (oneDNN;
AMX where the CPU has it) at M=1024, K=576, N=1536 (M=64 where it is
slow), on the threads torch uses, and the same GEMM through our own
linear; and which native kernel build loads."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from functools import lru_cache

FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Fingerprint:
    cpu_model: str
    logical_cpus: int
    torch_threads: int
    isa: tuple[str, ...]
    mem_gib: float
    copy_gbs: float
    torch_bf16_gemm_tflops: float
    gemm_m: int             # rows of that GEMM (576 x 1536 weights)
    ours_bf16_gemm_tflops: float  # the same GEMM through pdcluster.kernels.ops.linear on packed weights (nan: no native kernels)
    gpu: str
    native_kernels: str     # the pdcluster.kernels.cpu_native build loaded ("amx_bf16", "avx512_bf16", "avx2"), or "off"

    def lines(self) -> list[str]:
        return [f"machine: {self.cpu_model}, {self.logical_cpus} logical CPUs (torch threads {self.torch_threads}), "
                f"{self.mem_gib:.1f} GiB, GPU: {self.gpu}",
                f"machine: ISA {' '.join(self.isa) or '(none of ' + ' '.join(FLAGS) + ')'}; "
                f"native kernels: {self.native_kernels}",
                f"machine: copy {self.copy_gbs:.1f} GB/s (1 thread, 256 MiB), torch bf16 GEMM "
                f"{self.torch_bf16_gemm_tflops * 1e3:.1f} GFLOP/s ({self.gemm_m}x576x1536, oneDNN), ours "
                f"{self.ours_bf16_gemm_tflops * 1e3:.1f} GFLOP/s (pdcluster.kernels.ops.linear)"]


def _cpuinfo() -> tuple[str, tuple[str, ...]]:
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model, tuple(f for f in FLAGS if f in flags)


def _mem_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return float("nan")


def _best_seconds(fn, reps: int, budget_s: float = 1.0) -> float:
    """Best of ``reps`` timed calls after a warm-up, fewer when a call is slow
    (torch's bf16 GEMM without AVX-512 BF16 takes seconds)."""
    t0 = time.perf_counter()
    fn()  # warm-up (page faults, oneDNN primitive creation)
    reps = max(1, min(reps, int(budget_s / max(time.perf_counter() - t0, 1e-9))))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_copy_gbs(mib: int = 256) -> float:
    import torch
    src = torch.ones(mib * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return src.numel() / _best_seconds(lambda: dst.copy_(src), 5) / 1e9
    finally:
        torch.set_num_threads(threads)


def measure_bf16_gemm_tflops(m: int = 1024, k: int = 576, n: int = 1536) -> tuple[float, int]:
    """(TFLOP/s, rows used)."""
    import torch
    a = torch.randn(m, k).bfloat16()
    b = torch.randn(k, n).bfloat16()
    seconds = _best_seconds(lambda: torch.matmul(a[:64], b), 1, budget_s=0.0)  # a probe: slow CPUs get a small M
    if seconds > 0.05:
        m, a = 64, a[:64]
    return 2 * m * k * n / _best_seconds(lambda: torch.matmul(a, b), 5) / 1e12, m


def measure_ours_bf16_gemm_tflops(m: int, k: int = 576, n: int = 1536) -> float:
    """The fingerprint's GEMM through the engine's own linear (packed weights;
    AMX tiles or vector dot products, whichever ``pdcluster.kernels.ops`` routes to)."""
    import torch
    try:
        from pdcluster.kernels import ops
        if ops.native_variant() is None:
            return float("nan")
        x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
        packed = ops.pack_linear_weight(w)
        return 2 * m * k * n / _best_seconds(lambda: ops.linear(x, packed), 5) / 1e12
    except Exception:  # noqa: BLE001 - a fingerprint never fails a benchmark
        return float("nan")


def _native_kernels() -> str:
    try:
        from pdcluster.kernels import ops
        return ops.native_variant() or "off (torch reference ops)"
    except Exception as exc:  # noqa: BLE001 - a fingerprint never fails a benchmark
        return f"unknown ({type(exc).__name__})"


def _gpu() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a fingerprint never fails a benchmark
        pass
    return "none"


@lru_cache(maxsize=1)
def machine_fingerprint() -> Fingerprint:
    import torch
    model, isa = _cpuinfo()
    tflops, gemm_m = measure_bf16_gemm_tflops()
    return Fingerprint(cpu_model=model, logical_cpus=os.cpu_count() or 0, torch_threads=torch.get_num_threads(),
                       isa=isa, mem_gib=_mem_gib(), copy_gbs=measure_copy_gbs(),
                       torch_bf16_gemm_tflops=tflops, gemm_m=gemm_m,
                       ours_bf16_gemm_tflops=measure_ours_bf16_gemm_tflops(gemm_m), gpu=_gpu(),
                       native_kernels=_native_kernels())


def print_fingerprint() -> Fingerprint:
    fp = machine_fingerprint()
    for line in fp.lines():
        print(line, flush=True)
    return fp


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="Print this machine's fingerprint (CPU, ISA, copy bandwidth, "
                                        "bf16 GEMM speed), as every benchmark does first.").parse_args()
    print_fingerprint()
