"""The one block-hash definition shared by the engine, the router and the index.

    h_0 = H(seed        || tokens of block 0)
    h_i = H(h_{i-1}     || tokens of block i)

Only *full* blocks are hashed: a partial block can still change, so it is
never cached nor indexed.  ``seed`` is a 64-bit model fingerprint of the
weights, the KV pool dtype and the block size, so two models, two block
sizes or two KV dtypes (bf16 and int8 blocks hold different bytes) never
share entries; for 8-bit pools it also names how K was rotated and shifted
before quantizing (pdcluster/services/model_meta.py ``K_ROTATION_ID``, ``K_SMOOTHING_ID``).  Keys are unsigned 64-bit
ints (BLAKE2b with an 8-byte digest), stable across processes and runs --
unlike Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

BlockHash = int  # unsigned 64-bit


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def model_fingerprint(*parts: object) -> BlockHash:
    """A 64-bit seed from whatever identifies the model and KV layout
    (e.g. name, weights digest, dtype, block size)."""
    return _h64("\x1f".join(str(p) for p in parts).encode())


def hash_prompt_blocks(
    seed: BlockHash, token_ids: Sequence[int], block_size: int, start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``.

    ``start``/``parent`` resume a chain: hash blocks from block index
    ``start`` on, with ``parent`` the hash of block ``start - 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    prev = seed if parent is None else parent
    if start > 0 and parent is None:
        raise ValueError("resuming a hash chain needs the parent hash of block start-1")
    out: list[BlockHash] = []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for b in range(start, len(tokens) // block_size):
        prev = _h64(struct.pack("<Q", prev) + tokens[b * block_size:(b + 1) * block_size].tobytes())
        out.append(prev)
    return out
