"""Kernel tests run the Triton kernels through the CPU interpreter, and the native int8 linear in every
build that runs here."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from pdcluster.kernels import cpu_native

from kernel_cases import interpreted_kernels


@pytest.fixture(scope="session")
def tk():
    """The Triton kernel modules, interpreted (``tk.rope.apply_rope_triton`` ...)."""
    return interpreted_kernels()


@pytest.fixture(autouse=True)
def _seed():
    import torch
    torch.manual_seed(0)


# ---- the native int8 linear, every build that runs here (test_int8_linear*.py) ----------------------

EMULATED = "avx512_bf16_emulated"  # the AVX-512 BF16 build with its BF16 instructions emulated (emulated_bf16.c)


def _cc() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def _runnable_builds() -> list[str]:
    if not _cc():
        return []
    builds = [v.name for v in cpu_native.supported_variants()]
    flags = cpu_native._cpu_flags()
    if "avx512_bf16" not in builds and {"avx512f", "avx512bw", "avx512vl", "f16c", "fma"} <= flags:
        builds.append(EMULATED)
    return builds


def _emulated_library(tmp: Path) -> Path:
    out = tmp / "emulated_bf16.so"
    here = Path(__file__).with_name("emulated_bf16.c")
    done = subprocess.run([_cc(), "-O2", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-mavx512f",
                           "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c", f"-I{cpu_native.CSRC}", str(here), "-o",
                           str(out), "-lm"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="session", params=_runnable_builds())
def int8_build(request, tmp_path_factory):
    """(variant name, that build's library), each loaded on its own; on an AVX-512 CPU without BF16 also the
    AVX-512 BF16 build with those instructions emulated, so its int8 code runs here too."""
    if request.param == EMULATED:
        lib = ctypes.CDLL(str(_emulated_library(tmp_path_factory.mktemp("emulated"))))
    else:
        lib = ctypes.CDLL(str(cpu_native.build(which=next(v for v in cpu_native.VARIANTS if v.name == request.param))))
    fn = lib.pd_linear_int8
    fn.argtypes, fn.restype = cpu_native._SIGNATURES["pd_linear_int8"], None
    return request.param, lib
