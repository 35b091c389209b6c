"""The greedy head's screen (greedy_head.py), kept in a file so a replica
that starts later on the same head reads it instead of building it again.

Building the screen quantizes the whole LM head in fp32 torch ops: about a
second of one core for the default model's 49,152 x 576 head (measured on a
2-vCPU AMD EPYC), paid by every replica start and respawn, and by every
engine a test builds.  Read back it costs two SHA-256 passes and a copy
(about 0.1 s).

    <dir>/greedy-screen-v<SCREEN_FORMAT>-<V>x<K>-<sha256 of the head's bf16 bytes, 32 hex>.bin
    file = sha256(payload) (32 bytes) + payload (the packed screen's bytes)

The name carries the head's own digest, so a file is never used for another
head (another model, another dtype, a changed conversion); the payload's
digest catches a file damaged on disk, which would otherwise give the screen
wrong bounds and silently wrong greedy tokens.  A file that is missing,
short, damaged or unreadable counts as absent: the screen is built and the
file written again (atomically: a temporary file renamed into place, so a
reader never sees half of one).  A directory that cannot be written costs
only the reuse (logged)."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SCREEN_FORMAT = 1  # bump when greedy_head.pack's layout or quantize's rounding changes
DIGEST_BYTES = 32


def _digest(t: torch.Tensor) -> bytes:
    return hashlib.sha256(t.contiguous().view(torch.uint8).reshape(-1).numpy()).digest()


def file_for(directory: Path, weight: torch.Tensor) -> Path:
    """Where the screen of head ``weight`` [V, K] is kept under ``directory``."""
    v, k = weight.shape
    return directory / f"greedy-screen-v{SCREEN_FORMAT}-{v}x{k}-{_digest(weight).hex()[:32]}.bin"


def read(path: Path, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The payload at ``path`` as uint8 ``shape``, or None when the file is absent, of another
    size, or its bytes are not the ones written (logged)."""
    want = DIGEST_BYTES + int(torch.Size(shape).numel())
    try:
        with open(path, "rb") as f:
            data = bytearray(f.read(want + 1))
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("greedy head screen %s unreadable (%s): building it again", path, e)
        return None
    if len(data) != want or hashlib.sha256(memoryview(data)[DIGEST_BYTES:]).digest() != bytes(data[:DIGEST_BYTES]):
        log.warning("greedy head screen %s is damaged (%d bytes, %d expected, or a digest mismatch): building "
                    "it again", path, len(data), want)
        return None
    return torch.frombuffer(data, dtype=torch.uint8, offset=DIGEST_BYTES).view(shape)


def write(path: Path, payload: torch.Tensor) -> None:
    """``payload`` (uint8) at ``path``, atomically; a failure is logged, never raised."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(_digest(payload))
            f.write(payload.contiguous().reshape(-1).numpy().tobytes())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        log.warning("could not keep the greedy head screen at %s (%s): the next start builds it again", path, e)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def read_or_make(directory: Path, weight: torch.Tensor, shape: tuple[int, ...],
                 make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The screen payload of ``weight`` read from ``directory``, else ``make()``'s, kept there."""
    path = file_for(directory, weight)
    payload = read(path, shape)
    if payload is None:
        payload = make()
        write(path, payload)
    return payload
