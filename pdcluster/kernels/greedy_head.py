"""The greedy choice over a bf16 LM head without reading all of it.

A decode step's LM head is the biggest single weight it streams (49,152 x 576
bf16 for the default model: 57 MB, 21% of a batch-1 step's bytes; measured
13-16% of the step on a 2-vCPU AMD EPYC). Rows that only need their argmax
(greedy, no logprobs, no penalties, no grammar) get it from a screen instead:

1. an int8 copy of the head (per column and group of 32 k: codes and an fp16
   scale; 34 MB with what the bound needs) times the activations quantized
   to int8 per group, by VPDPBUSD (csrc/greedy_head.h), with a proven bound
   on each column's distance from its exact logit;
2. every column whose bound reaches the best lower bound is a candidate; the
   candidates' 32-column tiles of the packed bf16 head go through the same
   kernel the full head runs (``pd_linear_packed_bf16``, tile by tile, same
   rows, so the same path and the same bits per logit), and the argmax is
   taken over them (csrc/greedy_head.h ``pd_greedy_head_pick``).

A column left out rounds, in bf16, strictly below the best column's logit
(csrc/greedy_head.h says why), so the token is the full head's argmax, its
tie-break included. When the screen cannot decide cheaply (too many
candidate tiles, a non-finite activation or logit, too many rows) the
caller runs the full head; nothing is approximated.

Built where the native AVX-512 BF16 kernels run and the CPU has AVX-512
VNNI (Sapphire Rapids, Zen 4); elsewhere :func:`build` returns None.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pdcluster.kernels import cpu_native, greedy_head_file
from pdcluster.kernels.huge_pages import on_huge_pages

COLS, GROUP = 16, 32          # GH_COLS, GH_K in csrc/greedy_head.h
GROUP_BYTES = COLS * GROUP + 3 * COLS * 2
MAX_ROWS = 16                 # at most GH_MAX_ROWS (64)
SCREEN_ROWS = 1  # in the engine, 4 and 8 rows ran slower with the screen than without (AMD EPYC Zen 4)
CANDIDATE_SHARE = 8           # at most 1 / 8 of the head's tiles as candidates: their exact logits cost 1 / 8 of it


@dataclass(frozen=True)
class ScreenedHead:
    """The screen's packed weights for a head of ``vocab`` x ``hidden``."""
    packed: torch.Tensor       # uint8 [vocab / 16, hidden / 32, GROUP_BYTES]
    vocab: int
    hidden: int


@dataclass(frozen=True)
class _Buffers:
    """One thread's scratch for a vocabulary's size, kept between calls (a fresh allocation of this
    size is an mmap that page-faults on every step); per thread, so engines sharing a model's
    weights on different threads never share it."""
    scratch: torch.Tensor      # the kernel's upper bounds, block lower bounds and marks for MAX_ROWS rows
    tiles: torch.Tensor        # int32 [vocab / 32]: the candidate tiles' indices
    exact: torch.Tensor        # bf16 [MAX_ROWS, 32]: one candidate tile's exact logits
    picked: torch.Tensor       # int64 [MAX_ROWS]: each row's token


_local = threading.local()


def scratch_bytes(vocab: int, rows: int = MAX_ROWS) -> int:
    """What pd_greedy_head_screen needs for ``rows`` rows (csrc/greedy_head.h)."""
    return rows * vocab * 4 + rows * (vocab // COLS) * 4 + rows * (vocab // 32)


def _buffers(vocab: int) -> _Buffers:
    held = getattr(_local, "buffers", {})
    if vocab not in held:
        held[vocab] = _Buffers(torch.empty(scratch_bytes(vocab) // 4 + 16, dtype=torch.float32),
                               torch.empty(vocab // 32, dtype=torch.int32),
                               torch.empty(MAX_ROWS, 32, dtype=torch.bfloat16), torch.empty(MAX_ROWS, dtype=torch.int64))
        _local.buffers = held
    return held[vocab]


def _round_up_bf16(t: torch.Tensor) -> torch.Tensor:
    """bf16 values >= t (fp32, non-negative): the next bf16 up where rounding went down."""
    b = t.to(torch.bfloat16)
    up = (b.view(torch.int16) + 1).view(torch.bfloat16)  # non-negative: the next representable value
    return torch.where(b.float() < t, up, b)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [V, K] -> codes int8 [V, K], d fp16 [V, G], L and E bf16 [V, G] (pure):
    d = max|W_g| / 127 rounded up to fp16, q = round(W / d), E = max |W - d q| and
    L = d * sum |q| over each group, both rounded up to bf16.  In fp32: d q is exact (11 x 8
    bits), and so is W - d q (within a factor 2 of each other where q != 0; W itself where q = 0)."""
    v, k = weight.shape
    w = weight.float().reshape(v, k // GROUP, GROUP)
    amax = w.abs().amax(dim=-1)
    d = (amax / 127).half()
    inf = torch.tensor(float("inf"))
    d = torch.where(d.float() * 127 < amax, torch.nextafter(d.float(), inf).half(), d)
    df = d.float().unsqueeze(-1)
    q = torch.where(df > 0, torch.round(w / torch.where(df > 0, df, 1.0)), 0.0).clamp_(-127, 127)
    err = (w - df * q).abs_().amax(dim=-1)
    l1 = df.squeeze(-1) * q.abs().sum(dim=-1)  # rounded in fp32: the bound's 0.1% covers it
    return q.to(torch.int8).reshape(v, k), d, _round_up_bf16(l1), _round_up_bf16(err)


def screen_shape(vocab: int, hidden: int) -> tuple[int, int, int]:
    return vocab // COLS, hidden // GROUP, GROUP_BYTES


def screen_bytes(weight: torch.Tensor) -> torch.Tensor:
    """The screen's bytes for a bf16 head ``weight`` [V, K] (V % 32 == 0, K % 32 == 0), uint8
    ``screen_shape(V, K)`` (pure)."""
    v, k = weight.shape
    g = k // GROUP
    q, d, l1, err = quantize(weight)
    # codes as u8 (q + 128), per (16-column block, group): [8 quads][16 columns][4 k]
    u = (q.to(torch.int16) + 128).to(torch.uint8).reshape(v // COLS, COLS, g, 8, 4).permute(0, 2, 3, 1, 4)
    codes = u.reshape(v // COLS, g, COLS * GROUP)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [V, G] 16-bit -> [V / 16, G, 32] bytes
        return t.contiguous().view(torch.int16).reshape(v // COLS, COLS, g).permute(0, 2, 1).contiguous() \
            .view(torch.uint8).reshape(v // COLS, g, COLS * 2)

    return torch.cat([codes, per_block(d), per_block(l1), per_block(err)], dim=-1)


def pack(weight: torch.Tensor, keep_in: Path | None = None) -> ScreenedHead:
    """The screen for a bf16 head ``weight`` [V, K], on huge pages; with ``keep_in``, read from the
    file greedy_head_file.py keeps there when one holds this head's, else built and kept there."""
    v, k = weight.shape
    if keep_in is None:
        payload = screen_bytes(weight)
    else:
        payload = greedy_head_file.read_or_make(keep_in, weight, screen_shape(v, k), lambda: screen_bytes(weight))
    return ScreenedHead(on_huge_pages([payload])[0], v, k)


def available() -> bool:
    """The screen runs here: the native AVX-512 BF16 build (or AMX) on a CPU with AVX-512 VNNI."""
    return (cpu_native.loaded_variant() in ("amx_bf16", "avx512_bf16")
            and cpu_native.cpu_has("avx512_vnni"))


def build(weight: torch.Tensor, keep_in: Path | None = None) -> ScreenedHead | None:
    """The screen for this head, or None where it cannot run (not a CPU bf16 head, shapes, ISA);
    ``keep_in``: see ``pack``."""
    v, k = weight.shape
    if (weight.dtype is not torch.bfloat16 or not weight.is_cpu or v % 32 or k % GROUP or k > 8192
            or not available()):
        return None
    return pack(weight, keep_in)


def choose(head: ScreenedHead, packed_bf16: torch.Tensor, x: torch.Tensor) -> list[int] | None:
    """Each row's argmax over ``x @ W^T`` (bf16 ``x`` [M, K]; ``packed_bf16``: W as
    ``cpu_native.pack_weight`` packs it, what the full head runs), or None: run the full head."""
    if (packed_bf16.dim() != 4 or packed_bf16.shape[0] * 32 != head.vocab or not packed_bf16.is_contiguous()
            or x.dim() != 2 or x.dtype is not torch.bfloat16 or x.shape[0] > MAX_ROWS or x.shape[1] != head.hidden):
        return None
    x, rows, buf = x.contiguous(), x.shape[0], _buffers(head.vocab)
    lib, threads, scratch = cpu_native.library(), cpu_native.num_threads(), buf.scratch.data_ptr()
    found = lib.pd_greedy_head_screen(x.data_ptr(), rows, head.hidden, head.packed.data_ptr(), head.vocab,
                                      scratch + (-scratch) % 64, buf.tiles.data_ptr(), threads)
    if found < 0 or found * CANDIDATE_SHARE > head.vocab // 32:
        return None
    failed = lib.pd_greedy_head_pick(x.data_ptr(), rows, head.hidden, packed_bf16.data_ptr(), buf.tiles.data_ptr(),
                                     found, buf.exact.data_ptr(), buf.picked.data_ptr(), threads)
    return None if failed else buf.picked[:rows].tolist()
