"""Compile every Triton kernel for a CUDA target (sm_90) with no GPU present.

The CPU interpreter accepts code the real compiler rejects (dot shapes under
16, non-constexpr globals, dtype mixes), so this runs each wrapper once on
small CPU tensors with the launcher swapped for a recorder, then compiles
each recorded launch through Triton's full pipeline down to a cubin with the
bundled ptxas.  Run as a script, without TRITON_INTERPRET:

    .venv/bin/python tests/unit/kernels/aot_compile.py

Prints one line per compiled kernel, ``ok N`` at the end; exit 1 on failure.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
           torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8"}
_launches: list[tuple[JITFunction, tuple, dict]] = []


def _record(self, *args, grid, warmup, **kwargs):
    _launches.append((self, args, kwargs))


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2**31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no signature type for {type(value)}")


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict, target: GPUTarget) -> None:
    values = dict(zip(fn.arg_names, args)) | kwargs
    constexprs = {p.name: values[p.name] for p in fn.params if p.is_constexpr}
    signature = {name: "constexpr" if name in constexprs else _arg_type(values[name]) for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=target)
    if not kernel.asm.get("cubin"):
        raise RuntimeError("no cubin produced")


def main() -> int:
    import tests.unit.kernels.kernel_cases as cases
    JITFunction.run = _record
    cases.run_every_wrapper_once()
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for fn, args, kwargs in _launches:
        t0 = time.perf_counter()
        try:
            compile_launch(fn, args, kwargs, target)
            print(f"compiled {fn.__name__} for sm_90 in {time.perf_counter() - t0:.1f}s")
        except Exception as err:  # report every kernel, then fail
            failed += 1
            print(f"FAILED {fn.__name__}: {type(err).__name__}: {str(err)[:2000]}")
    print(f"ok {len(_launches) - failed} failed {failed}")
    return 1 if failed or not _launches else 0


if __name__ == "__main__":
    sys.exit(main())
