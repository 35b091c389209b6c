"""Helpers shared by the Triton kernels (imported only where triton is).

Triton's CPU interpreter (``TRITON_INTERPRET=1``) stores bf16 as raw uint16
and does integer arithmetic on it, so every kernel upcasts to fp32 before
arithmetic, and ``UPCAST_DOT`` makes ``tl.dot`` take fp32 operands when
interpreting.  On a GPU, 16-bit operands go to the tensor cores unchanged;
the math is the same (a bf16/fp16 product is exact in fp32), only the
accumulation order differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when ``@triton.jit`` kernels are being run by the CPU interpreter."""
    return bool(triton.knobs.runtime.interpret)


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(int(triton.next_power_of_2(int(n))), minimum)


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if interpreting():
        return
    devices = {t.device for t in tensors}
    if len(devices) > 1 or not tensors[0].is_cuda:
        raise ValueError(
            f"Triton kernel got tensors on {sorted(map(str, devices))}: it needs them all on one CUDA "
            "device (use pdcluster.kernels.ops for the torch path on CPU, or set TRITON_INTERPRET=1 before "
            "importing triton to test on CPU)")


@triton.jit
def dot_f32(a, b, UPCAST_DOT: tl.constexpr):
    """``a @ b`` accumulated in fp32; fp32 operands use full IEEE precision
    (no tf32) so the fp32 engine path stays comparable with the reference."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, UPCAST_DOT: tl.constexpr):
    """One tile of flash attention's online softmax (base-2 scores ``s``,
    values ``v``): rescales the running max ``m_i``, sum ``l_i`` and output
    ``acc`` and folds the tile in.  Shared by decode and prefill kernels."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, UPCAST_DOT)
    return m_new, l_i, acc
