"""A frame to or from a grammar compile worker arrives whole although a
signal interrupts its write (grammar_pool._write_frame): one write(2) of a
frame larger than the pipe returns early, with what it wrote, when a
handled signal arrives while it waits for the reader.  Real pipe, real
signal; the signal is sent once the kernel shows the writer waiting in
the pipe's write (its wchan), so it lands inside the blocked write."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import threading
from pathlib import Path

from pdcluster.services.engine import grammar_pool

PIPE_BYTES = 1 << 16


def _waits_in_pipe_write(native_id: int) -> bool:
    try:
        return "pipe_write" in Path(f"/proc/self/task/{native_id}/wchan").read_text()
    except OSError:
        return False


def test_a_frame_interrupted_by_a_signal_arrives_whole():
    data = bytes(range(256)) * (4 * PIPE_BYTES // 256)  # four pipes full
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    received: list[bytes] = []
    signals: list[int] = []
    main, main_native = threading.get_ident(), threading.get_native_id()

    def reader() -> None:
        for _ in range(60_000):  # the writer is blocked on the full pipe (a bound, not a verdict)
            if _waits_in_pipe_write(main_native):
                break
            threading.Event().wait(0.001)
        signal.pthread_kill(main, signal.SIGUSR1)
        while chunk := os.read(read_fd, 1 << 20):
            received.append(chunk)

    old = signal.signal(signal.SIGUSR1, lambda signum, frame: signals.append(signum))
    thread = threading.Thread(target=reader)
    try:
        with os.fdopen(write_fd, "wb", buffering=0) as pipe:
            thread.start()
            grammar_pool._write_frame(pipe, data)
        thread.join(60)
    finally:
        signal.signal(signal.SIGUSR1, old)
        os.close(read_fd)
    assert signals == [signal.SIGUSR1]  # the signal did arrive, during the write
    frame = b"".join(received)
    assert frame[:8] == struct.pack(">Q", len(data)) and frame[8:] == data, (len(frame), len(data))
