"""K rotation of an 8-bit KV pool: q and post-RoPE K of every head are
multiplied by one orthonormal Hadamard matrix before K is quantized
(QuaRot / SpinQuant), so attention is unchanged in real arithmetic::

    q . k = (H q) . (H k)          H = Sylvester Hadamard / sqrt(head_dim), H^T H = I

while a K row's few outlier channels are spread over all of it: its amax
falls towards its rms, and with it the int8 step (pdcluster/kernels/kv_quant.py: one
scale per row, amax / 127).  Only q and K turn: V rows and the attention
output stay as they are (rotating V too measured no better, below).

The model applies it (pdcluster/services/engine/model/llama.py and the native stack's
layer, pdcluster/kernels/csrc/portable_kernels.h) right after RoPE, on 8-bit pools
only; the pool's K rows then hold ``quantize(H k - H b)``, ``b`` the K
smoothing shift, so the shift the kernels see is ``H b``
(:func:`rotate_heads` of it).  Every kernel below that point (write, decode,
prefill with its chunk's own K; Triton, native or torch) runs unchanged, in
rotated space: on CUDA the rotation is these torch ops, and the Triton
kernels see ordinary rows.

What it costs: with bf16 weights the rotated q and K are rounded to bf16
again, so a prompt's prefill over an 8-bit pool is bf16 KV's only up to that
rounding (first-token log-probs 0.004-0.07 nats apart on
tests/integration/engine/test_kv8_greedy.py's prompts), no longer bit for
bit; it is still the same for every 8-bit format (quantization never reaches
it).  In fp32 the rounding is fp32's.  The transform itself is
D log2 D adds per head and token.

Bit-exact in every implementation: a fast Walsh-Hadamard transform, its
butterflies ``(a + b, a - b)`` in fp32 in one fixed order (adds only, so
no FMA contraction can reorder them), then one multiply by the fp32
``1 / sqrt(head_dim)`` (exact for head_dim a power of 4), rounded once to
the input's dtype.  head_dim must be a power of two; models whose head_dim
is not are never rotated (:func:`rotates`).

Measured (bench/micro/levers_kv.py, fp32 weights, 16 chat prompts x 64
greedy tokens, int8 KV vs bf16 KV, K smoothed; 2-core Xeon): 7 identical
unrotated, 12 with this rotation (--no-k-rotation for the A/B); fp8 e4m3 4
and 5; bf16 weights 7 and 6 (their noise floor).  The count is noisy at
this level: a prototype rotating by an fp32 matmul with the same H got 13,
and 8 random sign flips on H (equally good rotations, the same K error) got
12 14 10 13 11 14 12 9; rotating V as well got 12 (sign flips: 9 13 12 8 9
11 11 11), so V stays as it is.  For scale: fp32 KV matches bf16 KV on 12,
and a bf16 pool holding rotated K (no quantization, only bf16's rounding
moved) on 13-14: the remaining divergences sit at top-2 gaps of 0.008-0.03
nats, where any change to the KV's rounding flips them.  Against fp32 KV
(exact) rotated int8 matches 12 of 16 (divergences at gaps <= 0.013 nats),
as bf16 KV does (12, <= 0.021), unrotated int8 8 (<= 0.136).  Mean int8 error
of a K row relative to its norm (the prompts' own K, float64 reference
forward): 0.458 % -> 0.376 %, amax / rms 3.13 -> 2.58; V 0.697 % -> 0.582 %.
fp8 e4m3 (a relative format) gains nothing there: 1.55 % -> 1.61 %.
"""

from __future__ import annotations

import functools

import torch


def rotates(head_dim: int) -> bool:
    """Whether heads of this width can be rotated (a power of two)."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


@functools.cache
def _inv_sqrt(head_dim: int) -> float:
    """fp32 ``1 / sqrt(head_dim)``, each step correctly rounded like C's
    ``1.f / sqrtf(D)``; a Python float holding that fp32 value exactly, so it
    multiplies an fp32 tensor on any device with no copy."""
    return float(1.0 / torch.tensor(float(head_dim), dtype=torch.float32).sqrt())


def rotate_heads(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., head_dim] -> H x per row, in ``x``'s dtype (computed in
    fp32, rounded once).  H is symmetric and its own inverse."""
    d = x.shape[-1]
    if not rotates(d):
        raise ValueError(f"Hadamard rotation needs a power-of-two head_dim, got {d}")
    lead = x.shape[:-1]
    y = x.float()
    h = 1
    while h < d:  # butterfly stage h: element j (j's bit h clear) and j + h -> (a + b, a - b)
        y = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return (y.reshape(x.shape) * _inv_sqrt(d)).to(x.dtype)
