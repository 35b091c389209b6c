"""The disk tier: blocks spilled from the host tier, one file per block in a
directory of this replica's own, bounded in blocks, least recently used
first out.

A file is a self-describing record, verified in full before its bytes reach
the pool (a torn write, a flipped bit or another model's block is refused,
and the prefix is recomputed)::

    header   magic "PDKVBLK1" | seed u64 | hash u64 | num_tokens u32 | payload_bytes u32 | crc32 u32
    tokens   num_tokens x int32          the token ids the block covers
    payload  payload_bytes               the block as the pool holds it (8-bit stays 8-bit)

crc32 covers tokens and payload.  Records are written aside (``.tmp``) and
renamed into place, so a present ``.kvb`` file is never half written.  The
index (hash -> tokens) lives in memory: a replica starts with an empty
directory (stale files of an earlier run are removed), since only this
process knows what its blocks were computed from.

``write_record`` / ``read_record`` run on the tier's worker threads; the
``DiskTier`` index only on the engine thread.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"PDKVBLK1"
_HEADER = struct.Struct("<8sQQIII")
SUFFIX = ".kvb"


class CorruptBlockError(ValueError):
    """A tier record that does not describe the block asked for."""


@dataclass(frozen=True)
class BlockRecord:
    seed: int
    block_hash: int
    tokens: tuple[int, ...]
    payload: np.ndarray  # uint8, payload_bytes


def record_bytes(block_bytes: int, block_size: int) -> int:
    return _HEADER.size + 4 * block_size + block_bytes


def write_record(path: Path, seed: int, block_hash: int, tokens: tuple[int, ...], payload: np.ndarray) -> int:
    """Writes one record (aside, then renamed into place); returns its bytes.  Raises OSError."""
    tok = np.asarray(tokens, dtype="<i4").tobytes()
    crc = zlib.crc32(payload, zlib.crc32(tok))
    header = _HEADER.pack(MAGIC, seed, block_hash, len(tokens), payload.nbytes, crc)
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(tok)
            f.write(payload.data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return len(header) + len(tok) + payload.nbytes


def read_record(path: Path, seed: int, block_hash: int, block_size: int, block_bytes: int) -> BlockRecord:
    """Reads and checks one record: magic, seed, hash, sizes and crc32.
    Raises CorruptBlockError (or OSError when the file cannot be read)."""
    want = record_bytes(block_bytes, block_size)
    buf = bytearray(want + 1)
    with open(path, "rb") as f:
        n = f.readinto(buf)
    if n != want:
        raise CorruptBlockError(f"{path.name}: {n} bytes, a record is {want}")
    magic, rseed, rhash, ntok, nbytes, crc = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptBlockError(f"{path.name}: not a KV block record")
    if rseed != seed or rhash != block_hash:
        raise CorruptBlockError(f"{path.name}: holds block {rhash:#x} of seed {rseed:#x}, "
                                f"not {block_hash:#x} of {seed:#x}")
    if ntok != block_size or nbytes != block_bytes:
        raise CorruptBlockError(f"{path.name}: {ntok} tokens / {nbytes} bytes, expected {block_size} / {block_bytes}")
    view = memoryview(buf)[_HEADER.size:want]
    if zlib.crc32(view) != crc:
        raise CorruptBlockError(f"{path.name}: crc32 mismatch (the file was damaged)")
    tokens = tuple(np.frombuffer(view[:4 * ntok], dtype="<i4").tolist())
    return BlockRecord(rseed, rhash, tokens, np.frombuffer(view[4 * ntok:], dtype=np.uint8))


class DiskTier:
    def __init__(self, directory: str | os.PathLike, max_blocks: int):
        if max_blocks < 1:
            raise ValueError(f"the disk tier needs room for at least one block, got {max_blocks}: "
                             "raise kv_tiers.disk_bytes, or leave kv_tiers.disk_dir unset")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._index: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # hash -> tokens, oldest first
        self.clear()
        self.max_blocks = max_blocks

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def clear(self) -> None:
        """Removes every record (and half-written one) in the directory; the index empties."""
        for stale in (*self.dir.glob("*" + SUFFIX), *self.dir.glob("*.tmp")):
            stale.unlink(missing_ok=True)
        self._index = OrderedDict()

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    def tokens(self, block_hash: int) -> tuple[int, ...] | None:
        return self._index.get(block_hash)

    def add(self, block_hash: int, tokens: tuple[int, ...]) -> list[int]:
        """Lists a written block (newest); returns the hashes pushed out (delete their files)."""
        self._index[block_hash] = tokens
        self._index.move_to_end(block_hash)
        out = []
        while len(self._index) > self.max_blocks:
            h, _ = self._index.popitem(last=False)
            out.append(h)
        return out

    def touch(self, block_hash: int) -> None:
        if block_hash in self._index:
            self._index.move_to_end(block_hash)

    def remove(self, block_hash: int) -> bool:
        return self._index.pop(block_hash, None) is not None

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index
