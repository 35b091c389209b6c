"""The local span file, bounded: a JSONL file that rotates at a size cap.

    spans.jsonl        appended to (O_APPEND, mode 0600)
    spans.jsonl.1      the file before it
    ...
    spans.jsonl.<keep> the oldest kept; the one before it is gone
    spans.jsonl.lock   taken (flock) by whoever rotates

Several processes append to one path.  Before each line a writer reads the
size of the file its descriptor names; past the cap it takes the lock,
looks again (another process may have rotated already: the path then names
another inode) and only then renames.  A writer whose descriptor still
names a rotated file notices at its next batch and reopens the path, so on
disk there are at most ``keep + 1`` files of ``max_bytes``, each over by at
most one other process's batch.  A line longer than the cap is dropped and
counted, never written.

    PDCLUSTER_TRACE_FILE_MAX_BYTES   the cap of one file (default 64 MiB)
    PDCLUSTER_TRACE_FILE_KEEP        rotated files kept (default 3)
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_BYTES_ENV = "PDCLUSTER_TRACE_FILE_MAX_BYTES"
KEEP_ENV = "PDCLUSTER_TRACE_FILE_KEEP"
DEFAULT_MAX_BYTES = 64 * 2**20
DEFAULT_KEEP = 3
FILE_MODE = 0o600


@dataclass(frozen=True)
class SpanFileLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    keep: int = DEFAULT_KEEP

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"{MAX_BYTES_ENV} must be >= 1 byte, got {self.max_bytes}: "
                             "set a cap such as 67108864 (64 MiB), or PDCLUSTER_TRACE_FILE=off for no file")
        if self.keep < 0:
            raise ValueError(f"{KEEP_ENV} must be >= 0 rotated files, got {self.keep}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SpanFileLimits:
        def number(name: str, default: int) -> int:
            raw = env.get(name, "").strip()
            try:
                return int(raw) if raw else default
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a whole number: set it to an integer, "
                                 f"or unset it for {default}") from None
        return cls(number(MAX_BYTES_ENV, DEFAULT_MAX_BYTES), number(KEEP_ENV, DEFAULT_KEEP))


def rotated_path(path: Path, i: int) -> Path:
    return path if i == 0 else path.with_name(f"{path.name}.{i}")


def rotation_moves(path: Path, keep: int) -> list[tuple[Path, Path]]:
    """The renames of one rotation, in order: each file one step older, the
    oldest overwritten.  With ``keep`` 0 the live file is simply dropped."""
    return [(rotated_path(path, i - 1), rotated_path(path, i)) for i in range(keep, 0, -1)]


def span_file_paths(path: Path, keep: int) -> list[Path]:
    """The live file and the rotated ones that exist, oldest first (reading order)."""
    return [p for p in (rotated_path(path, i) for i in range(keep, -1, -1)) if p.is_file()]


def needs_rotation(file_size: int, line_bytes: int, max_bytes: int) -> bool:
    """Whether appending the line would take a non-empty file past the cap."""
    return file_size > 0 and file_size + line_bytes > max_bytes


class SpanFile:
    """Appends whole lines to ``path``, rotating at ``limits``; thread-safe."""

    def __init__(self, path: str | Path, limits: SpanFileLimits | None = None):
        self.path = Path(path)
        self.limits = limits or SpanFileLimits.from_env()
        self.num_dropped_lines = 0  # lines longer than the cap
        self.num_rotations = 0      # done by this process
        self._fd: int | None = None
        self._lock = threading.Lock()

    def append(self, lines: Sequence[bytes]) -> None:
        """Writes each line in one ``write()`` (never interleaved with another writer's)."""
        with self._lock:
            self._follow()
            for line in lines:
                if len(line) > self.limits.max_bytes:
                    self.num_dropped_lines += 1
                    continue
                if needs_rotation(os.fstat(self._fd).st_size, len(line), self.limits.max_bytes):
                    self._rotate(len(line))
                os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            self._close()

    # ---- the descriptor ------------------------------------------------
    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(self._fd, FILE_MODE)  # a file an older version left 0644
        except PermissionError:
            pass  # another user's file: append only

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _is_current(self) -> bool:
        """Whether our descriptor still names the file at ``path``."""
        try:
            return os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            return False

    def _follow(self) -> None:
        if self._fd is not None and self._is_current():
            return
        self._close()
        self._open()

    def _rotate(self, line_bytes: int) -> None:
        lock_path = self.path.with_name(self.path.name + ".lock")
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            self._follow()  # another process may have rotated while we waited
            if not needs_rotation(os.fstat(self._fd).st_size, line_bytes, self.limits.max_bytes):
                return
            for src, dst in rotation_moves(self.path, self.limits.keep):
                if src.exists():
                    os.replace(src, dst)
            if self.limits.keep == 0:
                self.path.unlink(missing_ok=True)
            self.num_rotations += 1
            self._close()
            self._open()
        finally:
            os.close(lock_fd)  # releases the flock
