"""A replica's "I have requests" byte, read by the replicas on its host.

A replica that computes with an idle neighbour's cores (core_lending.py)
must give them back the moment the neighbour gets work.  The status board
says that within its publish period (0.5 s) plus the borrower's read period,
long enough for a decode replica on borrowed cores to slow the neighbour's
prefill for that whole time.  So each replica also keeps one byte in a file
under /dev/shm (memory, this host only), set while it has a request in
flight; a borrower reads its neighbours' bytes before every engine step:

    /dev/shm/pdcluster-<cluster>-<replica>.busy     1 while in_flight > 0, else 0

The file is created by its replica and removed when the replica stops (and
every flag of a cluster when the `pdcluster up` that started its Ray stops:
a killed replica cannot remove its own); a file that is missing (a replica
of another host) reads as unknown, never as idle, and a dead replica's is
never read (it is not on the board)."""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterable
from pathlib import Path

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def flag_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))


def flag_path(cluster: str, replica: str, directory: Path | None = None) -> Path:
    """The flag file of ``replica`` of ``cluster`` (names reduced to file-name characters)."""
    return (directory or flag_dir()) / f"pdcluster-{_SAFE.sub('_', cluster)}-{_SAFE.sub('_', replica)}.busy"


def remove_flags(cluster: str, directory: Path | None = None) -> int:
    """Removes every replica's flag of ``cluster`` on this host; how many."""
    removed = 0
    for path in (directory or flag_dir()).glob(f"pdcluster-{_SAFE.sub('_', cluster)}-*.busy"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


class BusyFlag:
    """This replica's byte: ``set(True)`` when it gets a request, ``set(False)``
    when its last one ends; ``close()`` removes the file."""

    def __init__(self, path: Path):
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, 1)
            self._map = mmap.mmap(fd, 1)
        finally:
            os.close(fd)
        self._busy = False

    def set(self, busy: bool) -> None:
        if busy != self._busy and not self._map.closed:
            self._map[0] = 1 if busy else 0
            self._busy = busy

    def close(self) -> None:
        if not self._map.closed:
            self._map.close()
        self.path.unlink(missing_ok=True)


class FlagReader:
    """The neighbours' bytes; files stay mapped between reads (a read is a
    memory load, cheap enough for every engine step)."""

    def __init__(self):
        self._maps: dict[Path, mmap.mmap] = {}

    def any_busy(self, paths: Iterable[Path]) -> bool | None:
        """True if any neighbour has a request in flight, False if none has,
        None if a flag cannot be read (then the caller cannot know)."""
        busy = False
        for path in paths:
            m = self._maps.get(path)
            if m is None:
                m = self._open(path)
            if m is None:
                return None
            try:
                busy = busy or m[0] != 0
            except ValueError:  # unmapped meanwhile by forget_others (the board reader's thread)
                return None
        return busy

    def forget_others(self, keep: Iterable[Path]) -> None:
        """Unmaps the flags of replicas no longer on the board."""
        keep = set(keep)
        for path in [p for p in self._maps if p not in keep]:
            self._maps.pop(path).close()

    def close(self) -> None:
        self.forget_others(())

    def _open(self, path: Path) -> mmap.mmap | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            m = mmap.mmap(fd, 1, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        self._maps[path] = m
        return m
