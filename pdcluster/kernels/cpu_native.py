"""Native CPU kernels for bf16, built on first use and called through ctypes.

Three variants of one C ABI; the best one this CPU runs is loaded:

    amx_bf16     csrc/cpu_kernels.c -DPD_AMX  the avx512_bf16 kernels, with the packed linear and the
                                              prefill attention products on AMX tiles (Sapphire Rapids on)
    avx512_bf16  csrc/cpu_kernels.c       AVX-512 BF16 dot products (Sapphire Rapids, Zen 4)
    avx2         csrc/cpu_kernels_avx2.c  bf16 widened to fp32 in registers, FMA (Zen 2/3, Haswell on)

Built with the system C compiler into ``$PDCLUSTER_CACHE_DIR`` (default
``~/.cache/pdcluster``), one file per variant keyed by a hash of the sources
and flags, written atomically so concurrent replicas can race safely.
Parallel loops run on the kernels' own work pool (``csrc/work_pool.h``),
sized by :func:`set_num_threads` (default: torch's thread count).
``PDCLUSTER_CPU_KERNELS``: unset or ``1`` picks the best variant, a variant's
name forces it (where the CPU runs it), ``0`` turns the kernels off.
Unavailable (``library()`` is None, and ``pdcluster.kernels.ops`` uses the torch
references) when the CPU has neither variant's instructions, no compiler is
found, the build fails, or ``PDCLUSTER_CPU_KERNELS=0``.

Every shape goes to the native kernels, by measurement (``bench.micro.kernel_speed``,
2-vCPU AMD EPYC, AVX2 only, 2 threads): torch's bf16 linear runs at 1-20
GFLOP/s there, so the only rival is torch fp32 on upcast weights (twice the
weight memory, x and y converted per call).  The AVX2 linear is ahead of it
at every SmolLM2 projection: M=1 2.0-3.6x, M=16 1.5-1.7x, M=256 1.07-1.27x,
M=1024 1.03-1.04x (130-175 GFLOP/s); and on one thread at M=256 x 576 x 3072
it does 92 GFLOP/s to torch fp32's 81-89.

AMX (csrc/amx_linear.h), by measurement on a 2-core Sapphire Rapids VM
(SmolLM2-135M shapes; ``bench.micro.kernel_speed --prefill-only`` prints
the current figures): every linear whose K is a multiple of 32 takes the
tiles, at every M.  It must be every M or none: exact resume replays decode
steps one row at a time and needs each row's sum to be the same whatever
batch it came in, and the tiles sum in another order than the dot
products.  And every M is faster: on one thread against the AVX-512 BF16
dot products, with the weights in cache, M=1 qkv 9.6 vs 20.4 us, o 6.8 vs
12.8, down 28 vs 34; M=8 1.8-6.6x; M=1024 10-12x (qkv 1.31, gate_up 1.15,
down 1.35 TFLOP/s); with the weights streamed from memory, as in decode
(120 linears, 212 MB), M=1 17.0 vs 17.7 ms on one thread and 8.65 vs 9.46
on two, M=4 8.73 vs 11.77 ms on two.  In the engine (2 threads, quiet,
alternating builds), a 1024-token prompt's prefill went from 1.22-1.25 s
to 0.23-0.27 s, the batch-16 decode step from 35-36 to 19.5-21 ms, and the
batch-1 step stayed where it was (medians of 96 steps, three alternations:
12.53, 12.34, 12.14 ms before; 12.67, 11.84, 12.50 after).  On two threads of a quiet machine, at 1024 rows, qkv + o + gate_up + down
run at 2.50 TFLOP/s (2.4-2.7 each) and torch's at 2.46.
Torch's bf16 linear (oneDNN, also on the tiles) was the other candidate:
on one thread it is 1.3-4.9x slower than ours at M <= 64, level at 256,
and 5-45% faster at M >= 1024 (1.42-1.66 TFLOP/s); on two quiet threads
2.3-2.9x slower at M=16, level at 256 and 1024 in sum (gate_up 1.5x
faster, down 1.8x slower); and on two threads of a machine whose cores
something else also runs, its OpenMP barriers wait for a preempted thread
and every call took >= 4.6 ms whatever its size, while the work pool here
(csrc/work_pool.h) never waits on a thread that is not working.  Routing
to it would also cost a plain copy of every projection (212 MB at
SmolLM2-135M) and the per-layer Python path instead of the fused stack.  So the tiles stay inside our kernels, inside
:class:`DecoderStack`, and the packed weights are their only copy.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pdcluster.kernels.prefill_attention import ChunkKV

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
COMMON_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-fno-math-errno"]


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its source, its ISA flags, and the
    /proc/cpuinfo flags a CPU needs to run it."""
    name: str
    source: Path
    isa_flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]

    @property
    def flags(self) -> list[str]:
        return [*COMMON_FLAGS, *self.isa_flags]


# The int8 linears (csrc/int8_linear.h) widen their codes to bf16: no int8 products, no VNNI or AMX-int8 needed
_AVX512_BF16 = (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c"),
                ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"))
VARIANTS = (  # best first
    Variant("amx_bf16", CSRC / "cpu_kernels.c", (*_AVX512_BF16[0], "-mamx-tile", "-mamx-bf16", "-DPD_AMX"),
            (*_AVX512_BF16[1], "amx_tile", "amx_bf16")),
    Variant("avx512_bf16", CSRC / "cpu_kernels.c", *_AVX512_BF16),
    Variant("avx2", CSRC / "cpu_kernels_avx2.c", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
)

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
class LayerWeights(ctypes.Structure):
    """``pd_layer_weights``: one decoder layer's (packed) weights."""
    _fields_ = [(n, _ptr) for n in ("ln1", "w_qkv", "b_qkv", "w_o", "ln2", "w_gate_up", "w_down")]


class LayerStep(ctypes.Structure):
    """``pd_layer_step``: what every layer of one forward shares."""
    _fields_ = [*((n, _i64) for n in ("T", "hidden", "inter", "H", "KVH", "D", "num_layers", "block_size")),
                *((n, _ptr) for n in ("positions", "slots", "cos", "sin")),
                ("n_decode", _i64), ("decode_max_blocks", _i64), ("decode_tables", _ptr), ("decode_lens", _ptr),
                ("n_prefill_seqs", _i64), ("prefill_max_blocks", _i64),
                *((n, _ptr) for n in ("prefill_tables", "prefill_starts", "prefill_lens")),
                ("scale", _f32), ("eps", _f32), ("nthreads", _int),
                *((n, _ptr) for n in ("normed", "qkv", "attn", "proj", "gate_up", "act")),
                ("kv_kind", _i64), ("k_shift", _ptr), ("prefill_fresh", _ptr), ("k_rotate", _i64),
                ("weight_kind", _i64)]


_SIGNATURES = {
    "pd_pack_weight_bf16": [_ptr, _ptr, _i64, _i64],
    "pd_linear_packed_bf16": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int],
    "pd_paged_decode_attention_bf16": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                                       _i64, _i64, _i64, _f32, _int],
    "pd_prefill_attention_bf16": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                                  _i64, _i64, _f32, _int],
    "pd_add_rmsnorm_bf16": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int],
    "pd_silu_mul_bf16": [_ptr, _ptr, _i64, _i64, _int],
    "pd_decoder_stack_bf16": [ctypes.POINTER(LayerWeights), _i64, ctypes.POINTER(LayerStep), _ptr, _ptr, _ptr, _ptr],
    "pd_rope_bf16": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr],
    "pd_write_kv_bf16": [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64],
    "pd_hadamard_rows_bf16": [_ptr, _i64, _i64, _i64, _i64],
    "pd_argmax_rows_f32": [_ptr, _i64, _i64, _ptr, _ptr, _int],  # csrc/logits_argmax.h
    # int8 weights (csrc/int8_linear.h; pdcluster/kernels/int8_linear.py)
    "pd_linear_int8": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int],
    # 8-bit KV pools (csrc/kv8_kernels.h): the bf16 signatures plus the pool's kind (and the write's K shift,
    # and prefill's chunk K/V: pdcluster/kernels/prefill_attention.py ChunkKV)
    "pd_write_kv_q8": [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _int, _ptr],
    "pd_paged_decode_attention_q8": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                                     _i64, _i64, _i64, _f32, _int, _int],
    "pd_prefill_attention_q8": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                                _i64, _i64, _f32, _int, _int, _ptr, _ptr, _i64, _ptr, _ptr],
}

# Only in the AVX-512 builds (csrc/greedy_head.h; cpu_kernels.c): the greedy head's int8 screen
_SCREEN_SIGNATURES = {"pd_greedy_head_screen": [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int],
                      "pd_greedy_head_pick": [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _int]}

# Only in the amx_bf16 build (csrc/amx_linear.h): whether the tiles run here, and which linears take them.
_AMX_SIGNATURES = {"pd_amx_ready": [], "pd_linear_uses_amx": [_i64, _i64, _i64]}

# How a DecoderStack's projections are packed (PD_WEIGHTS_* in csrc/portable_kernels.h): bf16 by
# pack_weight, int8 (codes in groups of 32, 8 or 4 bits a code) by pdcluster/kernels/int8_linear.pack_int8_weight.
WEIGHT_KINDS = {"bf16": 0, "int8": 1, "int8_4bit": 2}

# The KV pool formats the native kernels read and write (PD_KV_* in csrc/kv8_kernels.h).
KV_KINDS = {torch.bfloat16: 0, torch.int8: 1, torch.float8_e4m3fn: 2}


_threads = 0


def set_num_threads(n: int) -> None:
    """Threads the native kernels use (0: follow ``torch.get_num_threads()``)."""
    global _threads
    _threads = max(0, int(n))


def num_threads() -> int:
    return _threads or torch.get_num_threads()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return frozenset(flags)


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` for this CPU."""
    return flag in _cpu_flags()


def supported_variants() -> list[Variant]:
    """The variants this CPU runs, best first."""
    return [v for v in VARIANTS if all(f in _cpu_flags() for f in v.cpu_flags)]


def cpu_supports() -> bool:
    return bool(supported_variants())


def variant() -> Variant | None:
    """The variant to load: the best this CPU runs, or the one
    ``PDCLUSTER_CPU_KERNELS`` names; None when off or unsupported."""
    wanted = os.environ.get("PDCLUSTER_CPU_KERNELS", "1")
    runnable = supported_variants()
    if wanted == "0" or not runnable:
        return None
    if wanted == "1":
        return runnable[0]
    chosen = next((v for v in runnable if v.name == wanted), None)
    if chosen is None:
        log.warning("PDCLUSTER_CPU_KERNELS=%s: this CPU runs %s; using %s", wanted,
                    ", ".join(v.name for v in runnable), runnable[0].name)
    return chosen or runnable[0]


def cache_dir() -> Path:
    return Path(os.environ.get("PDCLUSTER_CACHE_DIR", Path.home() / ".cache" / "pdcluster"))


def build(compiler: str | None = None, which: Variant = VARIANTS[0]) -> Path:
    """Compiles one variant of the kernels (or finds it already built);
    returns the .so.  Raises ``RuntimeError`` with the compiler's output on
    failure."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    source = b"".join(p.read_bytes() for p in sorted(CSRC.iterdir()) if p.suffix in (".c", ".h"))
    key = hashlib.sha256(source + " ".join([cc, which.source.name, *which.flags]).encode()).hexdigest()[:16]
    out = cache_dir() / f"cpu_kernels-{which.name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    done = subprocess.run([cc, *which.flags, str(which.source), "-o", tmp, "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building {which.source.name} failed:\n{done.stderr}")
    os.replace(tmp, out)
    return out


@functools.cache
def _loaded() -> tuple[ctypes.CDLL, Variant] | None:
    """The library and its variant: the one :func:`variant` picks, or, when
    that one does not build here (a compiler too old for ``-mamx-tile``,
    say), the next runnable one, so a build failure never costs more than
    the variant that failed."""
    which = variant()
    if which is None:
        return None
    for candidate in [which, *(v for v in supported_variants() if v is not which)]:
        try:
            lib = ctypes.CDLL(str(build(which=candidate)))
        except (RuntimeError, OSError) as e:
            log.warning("native CPU kernels: the %s variant is unavailable: %s", candidate.name, e)
            continue
        log.info("native CPU kernels: the %s variant (%s)", candidate.name, candidate.source.name)
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        for name, argtypes in _SCREEN_SIGNATURES.items() if candidate.source.name == "cpu_kernels.c" else ():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int64
        for name, argtypes in _AMX_SIGNATURES.items() if candidate.name == "amx_bf16" else ():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return lib, candidate
    log.warning("native CPU kernels unavailable, using the torch references")
    return None


def library() -> ctypes.CDLL | None:
    loaded = _loaded()
    return loaded[0] if loaded else None


def available() -> bool:
    return library() is not None


def loaded_library_name() -> str | None:
    """The file name of the loaded build (its variant and a hash of its source and flags), or None."""
    loaded = _loaded()
    return Path(loaded[0]._name).name if loaded else None


def loaded_variant() -> str | None:
    """The name of the variant in use ("amx_bf16", "avx512_bf16", "avx2"), or None."""
    loaded = _loaded()
    return loaded[1].name if loaded else None


AMX_K = 32  # the k depth of one AMX tile row in bf16 (AMX_K in csrc/amx_linear.h)
AMX_MIN_ROWS = 1  # x rows from which linears take the tiles (AMX_MIN_ROWS in csrc/amx_linear.h)


def linear_path(m: int, n: int, k: int, variant_name: str | None, amx_ready: bool = True) -> str:
    """Which kernel ``pd_linear_packed_bf16`` runs for x [m, k] times a packed
    [n, k] weight: "amx" (tile products), "dot" (the variant's vector dot
    products) or "torch" (no native kernels).  Mirrors ``pd_linear_uses_amx``:
    every m from AMX_MIN_ROWS takes the tiles, by measurement (see the module
    docstring), when the build has them, the kernel granted the tile state,
    and k is a multiple of the tile depth; the packing already needs
    n % 32 == 0."""
    if variant_name is None:
        return "torch"
    tiles = (variant_name == "amx_bf16" and amx_ready and m >= AMX_MIN_ROWS and k % AMX_K == 0
             and n % PACK_TILE == 0)
    return "amx" if tiles else "dot"


def amx_ready() -> bool:
    """True when the loaded build runs AMX tiles and Linux granted this
    process the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``)."""
    return loaded_variant() == "amx_bf16" and bool(library().pd_amx_ready())


def handles(*tensors: torch.Tensor) -> bool:
    """True when the native kernels can take these tensors: CPU bf16."""
    for t in tensors:
        if t.dtype is not torch.bfloat16 or not t.is_cpu:
            return False
    return available()


def handles_pool(kv_pool: torch.Tensor) -> bool:
    """True when the native kernels read and write this KV pool: a contiguous
    CPU pool of bf16 or of 8-bit rows (int8, fp8 e4m3; pdcluster/kernels/kv_quant.py)."""
    return kv_pool.dtype in KV_KINDS and kv_pool.is_cpu and kv_pool.is_contiguous() and available()


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


PACK_TILE = 32  # output columns per packed tile (TILE_N in the C source)


def packable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[0] % PACK_TILE == 0 and weight.shape[1] % 2 == 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> the packed [N / 32, K / 2, 32, 2] layout of :func:`linear`."""
    n, k = weight.shape
    w = weight.contiguous()
    packed = torch.empty(n // PACK_TILE, k // 2, PACK_TILE, 2, dtype=weight.dtype)
    library().pd_pack_weight_bf16(_p(w), _p(packed), n, k)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for bf16 ``x`` [..., K] and ``packed = pack_weight(W)``."""
    tiles, half_k, tile, _ = packed.shape
    n, k = tiles * tile, 2 * half_k
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=x.dtype)
    library().pd_linear_packed_bf16(_p(x2), _p(packed), _p(bias), _p(y), x2.shape[0], n, k, num_threads())
    return y.view(*x.shape[:-1], n)


def argmax_rows(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """For fp32 ``logits`` [rows, n] on the CPU: each row's argmax (the first
    index of its largest value, as ``torch.argmax``) and whether every value
    of the row is finite (a row that is not has no meaningful argmax)."""
    x = logits.contiguous()
    rows, n = x.shape
    index = torch.empty(rows, dtype=torch.int64)
    finite = torch.empty(rows, dtype=torch.int32)
    library().pd_argmax_rows_f32(_p(x), rows, n, _p(index), _p(finite), num_threads())
    return index.tolist(), [bool(f) for f in finite.tolist()]


def paged_decode_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    batch, heads, head_dim = q.shape
    _, num_layers, _, block_size, kv_heads, _ = kv_pool.shape
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype)
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    args = (_p(q), q.stride(0), _p(kv_pool), _p(out), _p(tables), _p(lens), batch, heads, kv_heads, head_dim,
            tables.shape[1], block_size, num_layers, layer, scale, num_threads())
    kind = KV_KINDS[kv_pool.dtype]
    if kind:
        library().pd_paged_decode_attention_q8(*args, kind)
    else:
        library().pd_paged_decode_attention_bf16(*args)
    return out


def prefill_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float, chunk: ChunkKV | None = None,
) -> torch.Tensor:
    """``chunk``: None, or the new tokens' own K/V (8-bit pools only; pdcluster/kernels/prefill_attention.py)."""
    tokens, heads, head_dim = q.shape
    _, num_layers, _, block_size, kv_heads, _ = kv_pool.shape
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype)
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    args = (_p(q), q.stride(0), _p(kv_pool), _p(out), _p(tables), _p(starts), _p(lens), lens.shape[0], heads,
            kv_heads, head_dim, tables.shape[1], block_size, num_layers, layer, scale, num_threads())
    kind = KV_KINDS[kv_pool.dtype]
    if chunk is not None:
        chunk.check(q, kv_pool, lens.shape[0])
    if kind:
        k, v, stride, fresh, shift = _chunk_args(chunk)
        library().pd_prefill_attention_q8(*args, kind, _p(k), _p(v), stride, _p(fresh), _p(shift))
    else:
        library().pd_prefill_attention_bf16(*args)
    return out


def _chunk_args(chunk: ChunkKV | None):
    """(k, v, row stride, fresh, k_shift) as pd_prefill_attention_q8 reads them: bf16
    rows with packed heads, one stride for both; int32 flags; fp32 shift."""
    if chunk is None:
        return None, None, 0, None, None
    k, v = chunk.k.to(torch.bfloat16), chunk.v.to(torch.bfloat16)
    if not (k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2]
            and k.stride(0) == v.stride(0)):
        k, v = k.contiguous(), v.contiguous()
    shift = None if chunk.k_shift is None else chunk.k_shift.contiguous()
    return k, v, k.stride(0), chunk.fresh.to(torch.int32).contiguous(), shift


def fused_add_rmsnorm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` None: plain RMSNorm of ``residual``."""
    out = torch.empty_like(residual)
    t, hidden = residual.reshape(-1, residual.shape[-1]).shape
    library().pd_add_rmsnorm_bf16(_p(x), _p(residual), _p(weight), _p(out), t, hidden, eps,
                                  num_threads())
    return out, residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for contiguous ``gate_up`` [T, 2 * I]."""
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    library().pd_silu_mul_bf16(_p(gate_up), _p(out), t, two_i // 2, num_threads())
    return out


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    pos = positions.to(torch.int64).contiguous()
    for x in (q, k):
        library().pd_rope_bf16(_p(x), x.stride(0), x.shape[0], x.shape[1], x.shape[2], _p(pos),
                               _p(cos_cache), _p(sin_cache))
    return q, k


def write_kv(kv_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_shift: torch.Tensor | None = None) -> None:
    """``k_shift``: None, or [kv_heads, head_dim] fp32 (K smoothing; 8-bit pools only)."""
    _, num_layers, _, block_size, kv_heads, _ = kv_pool.shape
    head_dim = k.shape[2]
    slots = slot_mapping.to(torch.int64).contiguous()
    args = (_p(kv_pool), _p(k), _p(v), k.stride(0), _p(slots), k.shape[0], kv_heads, head_dim, block_size,
            num_layers, layer)
    kind = KV_KINDS[kv_pool.dtype]
    if kind:
        shift = _k_shift(k_shift, (kv_heads, head_dim))
        library().pd_write_kv_q8(*args, kind, _p(shift))
    elif k_shift is not None:
        raise ValueError("k_shift (K smoothing) applies to 8-bit pools only: pass None for a bf16 pool")
    else:
        library().pd_write_kv_bf16(*args)


def _k_shift(k_shift: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The K shift as the C side reads it: contiguous fp32 of ``shape``."""
    if k_shift is None:
        return None
    if tuple(k_shift.shape) != shape or k_shift.dtype != torch.float32:
        raise ValueError(f"k_shift must be float32 of shape {shape}, got {k_shift.dtype} {tuple(k_shift.shape)}")
    return k_shift.contiguous()


def layer_weights(ln1: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None, w_o: torch.Tensor,
                  ln2: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> LayerWeights:
    """Pointers to one layer's weights (projections packed by :func:`pack_weight`);
    the tensors must outlive the returned struct."""
    return LayerWeights(*(_p(t) for t in (ln1, w_qkv, b_qkv, w_o, ln2, w_gate_up, w_down)))


class DecoderStack:
    """Runs a stack of decoder layers in one native call
    (``pd_decoder_stack_bf16``: the engine thread gives up the GIL once per
    step, not once per layer) over scratch buffers allocated per forward."""

    def __init__(self, layers: list[LayerWeights], hidden: int, inter: int, heads: int, kv_heads: int,
                 head_dim: int, eps: float, weight_kind: int = 0):
        """``weight_kind``: WEIGHT_KINDS' value for how every projection is packed."""
        self.layers = (LayerWeights * len(layers))(*layers)
        self.weight_kind = weight_kind
        self.hidden, self.inter = hidden, inter
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps

    def forward(self, hidden: torch.Tensor, batch, kv_pool: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, k_shift: torch.Tensor | None = None,
                rotate_qk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``: [T, hidden] embeddings (becomes the residual stream, in
        place); ``k_shift``: None or [layers, kv_heads, head_dim] fp32, K
        smoothing of an 8-bit pool (as its rows carry it: ``H b`` when
        rotated); ``rotate_qk``: q and K turn after RoPE (8-bit pools only,
        pdcluster/kernels/kv_rotation.py).  Returns (last layer's MLP output, residual)."""
        t, dt = hidden.shape[0], hidden.dtype
        h, d, kvh = self.heads, self.head_dim, self.kv_heads
        _, num_layers, _, block_size, _, _ = kv_pool.shape
        bufs = {"normed": torch.empty(t, self.hidden, dtype=dt), "qkv": torch.empty(t, (h + 2 * kvh) * d, dtype=dt),
                "attn": torch.empty(t, h * d, dtype=dt), "proj": torch.empty(t, self.hidden, dtype=dt),
                "gate_up": torch.empty(t, 2 * self.inter, dtype=dt), "act": torch.empty(t, self.inter, dtype=dt)}
        outs = (torch.empty(t, self.hidden, dtype=dt), torch.empty(t, self.hidden, dtype=dt))
        # ForwardBatch dtypes are what the C side reads: int64 positions and
        # slots, int32 tables and lengths; locals keep them alive for the call
        positions, slots = batch.positions.contiguous(), batch.slot_mapping.contiguous()
        dec_tables, dec_lens = batch.decode_block_tables.contiguous(), batch.decode_context_lens.contiguous()
        pre_tables, pre_lens = batch.prefill_block_tables.contiguous(), batch.prefill_context_lens.contiguous()
        pre_starts = batch.prefill_query_start_loc.contiguous()
        pre_fresh = batch.prefill_fresh_kv.to(torch.int32).contiguous()  # read over 8-bit pools only
        if k_shift is not None and not KV_KINDS[kv_pool.dtype]:
            raise ValueError("k_shift (K smoothing) applies to 8-bit pools only: pass None for a bf16 pool")
        if rotate_qk and not KV_KINDS[kv_pool.dtype]:
            raise ValueError("rotate_qk (K rotation) applies to 8-bit pools only: pass False for a bf16 pool")
        shift = _k_shift(k_shift, (len(self.layers), kvh, d))
        step = LayerStep(
            t, self.hidden, self.inter, h, kvh, d, num_layers, block_size,
            _p(positions), _p(slots), _p(cos), _p(sin),
            batch.num_decode_tokens, dec_tables.shape[1], _p(dec_tables), _p(dec_lens),
            pre_lens.shape[0], pre_tables.shape[1], _p(pre_tables), _p(pre_starts), _p(pre_lens),
            d ** -0.5, self.eps, num_threads(), *(_p(b) for b in bufs.values()), KV_KINDS[kv_pool.dtype],
            _p(shift), _p(pre_fresh), int(rotate_qk), self.weight_kind)
        library().pd_decoder_stack_bf16(self.layers, len(self.layers), ctypes.byref(step), _p(kv_pool), _p(hidden),
                                        _p(outs[0]), _p(outs[1]))
        return outs[(len(self.layers) - 1) % 2], hidden
