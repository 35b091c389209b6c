"""Linears over int8 weights (``weight_dtype: int8``): the torch references,
the packed layout the native kernels read, and the call into them.

    weights      per output channel, symmetric: scale[n] = max |W[n, :]| / 127,
                 Wq = round(W / scale) in [-127, 127]           (quantize_weight, once per load)
    W8A8         per token, dynamic: s[m] = max |x[m, :]| / 127, q = round(x * (127 / max |x[m, :]|));
                 y = bf16(float(sum_k q Wq) * (s[m] * scale[n]) + bias)    (int8_linear_ref)
    weight-only  y = bf16((x . Wq in fp32) * scale[n] + bias)              (weight_only_linear_ref)

The integer sums are exact on every native product (AMX-int8, AVX-512
VNNI, AVX2: csrc/int8_linear.h), so W8A8 is bit for bit the reference's on
each of them, whatever batch a row comes in.  Weight-only sums fp32 in k
order: close to the reference, not equal.

Which mode a model runs (``WEIGHT_MODE``) is decided by measurement
(``python -m bench.micro.weight_quant --kernels``: the 120 projections of
SmolLM2-135M, 2 threads, 2-vCPU AMD EPYC, ms and ratio to the bf16 linear):

    build         M   bf16     W8A8           weight-only
    avx512_bf16   1     9.40    5.40 (0.57x)    6.12 (0.65x)
    avx512_bf16  16    24.83   23.24 (0.94x)   54.74 (2.20x)
    avx512_bf16 256   435.86  233.25 (0.54x)  953.04 (2.19x)
    avx2          1    16.07   10.79 (0.67x)   12.77 (0.79x)
    avx2         16    63.15   50.65 (0.80x)   74.28 (1.18x)
    avx2        256   676.40  506.03 (0.75x)  904.06 (1.34x)

W8A8 is ahead at every row count on both builds, so it runs everywhere:
one mode for every row count in any case, because a row's output must not
depend on the batch it came in (exact resume).  Weight-only is the more
accurate (perplexity +0.35 % against W8A8's +1.37 %, projections only) and
stays for that comparison.
"""

from __future__ import annotations

import torch

from pdcluster.kernels import cpu_native

TILE = 32  # output columns per packed tile (TILE_N in the C source)
QMAX = 127
# The mode the model's int8 linears run in: "w8a8" | "weight_only" (see the module docstring).
WEIGHT_MODE = "w8a8"
_MODES = {"w8a8": 0, "weight_only": 1}
_PATHS = {0: "dot", 1: "amx_int8", 2: "weight_only"}


def _qmax_over(amax: torch.Tensor) -> torch.Tensor:
    """127 / amax as one fp32 division, as C's ``127.f / amax`` (torch's ``127 / t`` is ``t.reciprocal() * 127``:
    another rounding)."""
    return torch.full_like(amax, float(QMAX)) / amax


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (int8 [N, K], fp32 scale [N]), symmetric per output channel."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = amax / QMAX
    inv = torch.where(amax > 0, _qmax_over(amax), torch.zeros_like(amax))
    q = torch.round(w * inv[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] activations -> (int8 [M, K], fp32 scale [M]), as the native kernels round them."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    inv = torch.where(amax > 0, _qmax_over(amax), torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, amax / QMAX


def int8_accumulate(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Exact int32 sums ``xq @ wq.T`` (int64 on the way: torch has no int8 matmul on every device)."""
    return (xq.to(torch.int64) @ wq.to(torch.int64).T).to(torch.int32)


def int8_linear_ref(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """W8A8: ``x`` [..., K], ``wq`` [N, K] int8, ``w_scale`` [N] fp32 -> [..., N] in x's dtype (or out_dtype)."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_tokens(x2)
    y = int8_accumulate(xq, wq).float() * (xs[:, None] * w_scale[None, :].float())
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], wq.shape[0])


def weight_only_linear_ref(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                           bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Weight-only: the int8 weights widened, fp32 activations, one scale per output column."""
    y = (x.float() @ wq.float().T) * w_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def packable(wq: torch.Tensor) -> bool:
    return wq.dim() == 2 and wq.shape[0] % TILE == 0 and wq.shape[1] % 4 == 0


def pack_int8_weight(wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """(int8 [N, K], fp32 [N]) -> the packed tiles of csrc/int8_linear.h: int8
    [N / 32, K / 4 + 2, 32, 4], tile j's weights then its 32 scales and 32
    integer row sums (each 128 bytes: one [32, 4] row)."""
    if not packable(wq):
        raise ValueError(f"int8 packing needs N % {TILE} == 0 and K % 4 == 0, got {tuple(wq.shape)}")
    n, k = wq.shape
    tiles = wq.view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3)
    scale = w_scale.float().contiguous().view(n // TILE, 1, TILE).view(torch.int8).view(n // TILE, 1, TILE, 4)
    wsum = wq.to(torch.int32).sum(dim=1, dtype=torch.int32).view(n // TILE, 1, TILE).view(torch.int8).view(n // TILE, 1, TILE, 4)
    return torch.cat([tiles, scale, wsum], dim=1).contiguous()


def unpack_int8_weight(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (int8 [N, K], fp32 scale [N]) that :func:`pack_int8_weight` packed."""
    tiles, rows, tile, _ = packed.shape
    k = (rows - 2) * 4
    wq = packed[:, :-2].permute(0, 2, 1, 3).reshape(tiles * tile, k)
    scale = packed[:, -2].contiguous().view(torch.float32).reshape(tiles * tile)
    return wq, scale


def is_packed_int8(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.int8 and weight.dim() == 4


def native_takes(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.is_cpu and cpu_native.available()


def linear_native(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  mode: str = WEIGHT_MODE, fp32_out: bool = False, lib=None) -> torch.Tensor:
    """``x`` [..., K] bf16 on the CPU times a packed int8 weight; bf16 out (fp32 when ``fp32_out``).
    ``lib``: another loaded build of the kernels (tests run every variant); default the process's own."""
    tiles, rows, tile, _ = packed.shape
    n, k = tiles * tile, (rows - 2) * 4
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32 if fp32_out else x.dtype)
    b = None if bias is None else bias.to(torch.bfloat16).contiguous()
    p = cpu_native._p
    (lib or cpu_native.library()).pd_linear_int8(p(x2), p(packed), p(b), None if fp32_out else p(y),
                                        p(y) if fp32_out else None, x2.shape[0], n, k, _MODES[mode],
                                        cpu_native.num_threads())
    return y.view(*x.shape[:-1], n)


def int8_linear_path(m: int, n: int, k: int, variant_name: str | None, amx_ready: bool = True,
                     mode: str = WEIGHT_MODE) -> str:
    """Which product ``pd_linear_int8`` runs for x [m, k] times a packed [n, k]
    int8 weight: "amx_int8" (tiles: the amx build, tile state granted, k % 64
    == 0), "avx512_vnni" or "avx2" (the variant's dot products), "weight_only",
    or "torch" (no native kernels).  Mirrors ``pd_linear_int8_path``."""
    if variant_name is None:
        return "torch"
    if mode == "weight_only":
        return "weight_only"
    if variant_name == "amx_bf16" and amx_ready and k % 64 == 0:
        return "amx_int8"
    return "avx2" if variant_name == "avx2" else "avx512_vnni"


def native_path(m: int, n: int, k: int, mode: str = WEIGHT_MODE) -> str:
    """The C side's own answer for this process's loaded kernels (tests check the mirror against it)."""
    lib = cpu_native.library()
    if lib is None:
        return "torch"
    path = _PATHS[lib.pd_linear_int8_path(m, n, k, _MODES[mode])]
    return path if path != "dot" else ("avx2" if cpu_native.loaded_variant() == "avx2" else "avx512_vnni")
