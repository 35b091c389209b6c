"""A seeded request's random stream as a function of (seed, output position).

Why not one generator seeded once per request: its state after k draws lives
only in the replica that made them.  When that replica dies mid-stream, the
request resumes elsewhere from prompt + the k tokens already sent, and must
draw exactly what the original would have drawn for token k+1.  Reseeding
the generator before every draw with ``position_seed(seed, k)`` makes the
draw for output position k depend on nothing else::

    output position   0 (prefill replica)   1 ... k (decode replica A)   k+1 ... (replica B)
    generator seed    mix(seed, 0)          mix(seed, 1) ... mix(seed, k) mix(seed, k+1) ...

``mix`` is splitmix64's finaliser over the seed and the position, so nearby
seeds and positions give unrelated streams (a plain ``seed + position``
would make seed 7 at position 1 replay seed 8 at position 0)."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the draw of output token ``position`` (0 = the
    first output token) of a request seeded with ``seed``: an unsigned 64-bit
    integer, what ``torch.Generator.manual_seed`` takes."""
    if position < 0:
        raise ValueError(f"output position must be >= 0, got {position}")
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
