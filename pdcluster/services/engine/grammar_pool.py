"""The replica's grammar compilers: a bounded pool of worker processes,
each with a hard limit on one compile's CPU seconds.

    compile thread (GrammarCache, one per worker)      worker process (nice +10), one of N
    pool.compile(kind, source, limit) ──frame──▶      GrammarCompiler.compile_*(spec)
          ◀── "o" + CompiledGrammar.serialize_json()   (or "e" + why xgrammar refused it)
    CompiledGrammar.deserialize_json -> the cache      SIGXCPU at the limit: the worker ends

Why processes and not threads: xgrammar's compile is C++ that never
yields; a thread running it cannot be stopped, so a "time limit" on a
thread only stops the waiting, and a few pathological schemas would hold
every compile thread for as long as they like.  A process is killed at the
limit and replaced, so the limit is hard and the pool's size really bounds
the CPU that compiles take.  Why the real compile in the worker and not a
precheck there followed by a second compile here: ``CompiledGrammar``
serialises (``serialize_json`` / ``deserialize_json``, xgrammar 0.2.9), so
one compile suffices.  Measured on the 2-core test machine, a 40-property
schema (tests/slow_grammars.py): compile 3.3 s, serialise 2.1-2.9 s (a 49 MB
frame), deserialise 0.8 s; 20 properties: 1.06 s, 0.42 s.  Compile,
serialise and deserialise all release the GIL (a Python thread ticking
every 1 ms saw gaps of 4, 35 and 12 ms), so the replica's own part, the
deserialise, runs on a compile thread without holding up the engine
thread.  The workers run at nice +10: on a small machine the engine's step
wins the CPU, and a compile takes longer rather than a stream's next token.

The limit is CPU seconds of the worker's one job (compile and
serialisation), enforced by the kernel (RLIMIT_CPU, set before each job:
SIGXCPU ends the worker), so whether a spec is over the limit depends on the
spec, not on how busy the machine is; the kernel counts whole seconds, so a
limit is rounded up to the worker's next whole CPU second (under 1 s more).
A wall-clock backstop (``WALL_BACKSTOP_FACTOR`` times the limit) kills a
worker that stopped using CPU or is starved of it; its request gets the
same 400.  Neither counts the wait for a free worker nor a worker's start
(importing xgrammar pulls in torch: 2-3 s, much more on a loaded machine).
Frames on the worker's stdin and its private copy of stdout are an 8-byte
big-endian length and the bytes; the first frame a worker reads is the
tokenizer info (``TokenizerInfo.serialize_json``).  Nothing here imports
xgrammar in the replica's own process."""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

log = logging.getLogger(__name__)

_LEN = struct.Struct(">Q")
WORKER_START_TIMEOUT_S = 120.0   # a cold worker imports xgrammar and torch: seconds on a loaded machine
WORKER_NICE = 10
WALL_BACKSTOP_FACTOR = 6.0


class GrammarCompileTimeout(Exception):
    """A compile ran past the limit (CPU, or the wall-clock backstop); its worker was killed."""


class GrammarWorkerError(RuntimeError):
    """A worker died or spoke out of turn (not the spec's fault)."""


@dataclass(frozen=True)
class CompileOutcome:
    """A worker's answer: ``compiled_json`` (serialised CompiledGrammar), or
    ``error`` (why xgrammar refused the spec: the request's fault)."""
    compiled_json: str | None = None
    error: str | None = None
    seconds: float = 0.0


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, tokenizer_info_json: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "pdcluster.services.engine.grammar_pool"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
        try:
            _write_frame(self.proc.stdin, tokenizer_info_json.encode())
            ready = _read_frame(self.proc.stdout, time.monotonic() + WORKER_START_TIMEOUT_S)
        except (GrammarCompileTimeout, GrammarWorkerError, OSError):
            ready = None
        if ready != b"ready":
            self.kill()
            raise GrammarWorkerError(f"grammar compile worker did not start within {WORKER_START_TIMEOUT_S:g} s")

    def compile(self, kind: str, source: str, timeout_s: float) -> CompileOutcome:
        started = time.monotonic()
        _write_frame(self.proc.stdin, json.dumps({"kind": kind, "source": source, "cpu_s": timeout_s}).encode())
        try:
            reply = _read_frame(self.proc.stdout, started + timeout_s * WALL_BACKSTOP_FACTOR)
        except GrammarWorkerError:
            if self.proc.wait() == -signal.SIGXCPU:
                raise GrammarCompileTimeout() from None   # the kernel ended it at the CPU limit
            raise
        seconds = time.monotonic() - started
        if reply[:1] == b"o":
            return CompileOutcome(compiled_json=reply[1:].decode(), seconds=seconds)
        if reply[:1] == b"e":
            return CompileOutcome(error=reply[1:].decode(), seconds=seconds)
        raise GrammarWorkerError(f"grammar compile worker answered {reply[:16]!r}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


class GrammarCompilePool:
    """At most ``workers`` compiles at once, each killed at ``timeout_s``.
    Thread-safe; a caller waits for a free worker (that wait is not limited
    here: the request's own deadline bounds it).  Workers start on first use."""

    def __init__(self, tokenizer_info_json: str, workers: int = 2):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.tokenizer_info_json, self.workers = tokenizer_info_json, workers
        self._slots: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._slots.put(None)   # a free slot, its worker not started yet
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.num_dropped = 0   # workers killed at the limit, or found dead
        # A pool dropped without close() (an engine nobody closed) still ends its workers when collected:
        # each idle one holds some 300 MB, and nothing else would end them before this process ends.
        weakref.finalize(self, _kill_all, self._live)

    def compile(self, kind: str, source: str, timeout_s: float) -> CompileOutcome:
        """GrammarCompileTimeout past ``timeout_s``; GrammarWorkerError if the worker failed."""
        worker = self._slots.get()
        try:
            if worker is not None and worker.proc.poll() is not None:
                self._drop(worker)   # died while idle (killed from outside, out of memory)
                worker = None
            if worker is None:
                worker = self._start()
            outcome = worker.compile(kind, source, timeout_s)
        except (GrammarCompileTimeout, GrammarWorkerError, OSError) as exc:
            self._drop(worker)
            worker = None
            if isinstance(exc, OSError):
                raise GrammarWorkerError(f"grammar compile worker failed: {exc}") from None
            raise
        finally:
            self._slots.put(worker)
        return outcome

    def _start(self) -> _Worker:
        worker = _Worker(self.tokenizer_info_json)
        with self._lock:
            if self._closed:
                worker.kill()
                raise GrammarWorkerError("grammar compile pool is closed")
            self._live.add(worker)
        return worker

    def _drop(self, worker: _Worker | None) -> None:
        if worker is None:
            return
        with self._lock:
            self._live.discard(worker)
            self.num_dropped += 1
        worker.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            live = list(self._live)
            self._live.clear()   # the same set the finalizer holds
        for worker in live:
            worker.kill()


def _kill_all(live: set[_Worker]) -> None:
    for worker in list(live):
        worker.kill()
    live.clear()


def _write_frame(pipe, data: bytes) -> None:
    _write_all(pipe, _LEN.pack(len(data)))
    _write_all(pipe, data)
    pipe.flush()


def _write_all(pipe, data: bytes) -> None:
    """All of ``data`` to an unbuffered pipe.  One ``write`` may take only
    part of it: a frame larger than the pipe (the tokenizer info, a compiled
    grammar) blocks until the other side reads, and a signal handled in
    this process meanwhile ends the call with what was written so far.
    Dropping the rest left the worker waiting for bytes that never came
    and the caller for its answer (a unit test hung in a worker's start
    until pytest-timeout ended it, 15 minutes later)."""
    view = memoryview(data)
    while view:
        written = pipe.write(view)
        if not written:
            raise GrammarWorkerError("grammar compile worker's pipe took no bytes")
        view = view[written:]


def _read_frame(pipe, deadline: float) -> bytes:
    size = _LEN.unpack(_read_exact(pipe, _LEN.size, deadline))[0]
    return _read_exact(pipe, size, deadline)


def _read_exact(pipe, n: int, deadline: float) -> bytes:
    """``n`` bytes from an unbuffered pipe, GrammarCompileTimeout at ``deadline``."""
    fd, parts, got = pipe.fileno(), [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise GrammarCompileTimeout()
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise GrammarWorkerError("grammar compile worker exited")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


# ---- the worker process -------------------------------------------------------
def _worker_main() -> None:
    os.nice(WORKER_NICE)
    # Frames go out on a private copy of fd 1; fd 1 itself (Python's prints and
    # any native library's) now points at stderr, so nothing else can corrupt them.
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(_read_frame_blocking(stdin).decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write_frame(stdout, b"ready")
    while True:
        try:
            job = json.loads(_read_frame_blocking(stdin))
        except EOFError:
            return   # the replica closed the pipe or died
        _limit_cpu(job["cpu_s"])
        try:
            compiled = _compile(compiler, job["kind"], job["source"])
            reply = b"o" + compiled.serialize_json().encode()
        except (RuntimeError, ValueError, TypeError) as exc:
            reply = b"e" + _first_line(exc).encode()
        _limit_cpu(None)
        _write_frame(stdout, reply)


def _limit_cpu(seconds: float | None) -> None:
    """SIGXCPU (which ends this process) once it used ``seconds`` more CPU; None: no limit."""
    if seconds is None:
        soft = resource.RLIM_INFINITY
    else:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        soft = hard if soft == resource.RLIM_INFINITY else min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _compile(compiler, kind: str, source: str):
    if kind == "json_schema":
        # Compact separators: with free whitespace a small model can fill
        # max_tokens with newlines and never close the object.  Strict: only
        # the declared properties, which still validates against a schema
        # that allows more.
        return compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return compiler.compile_regex(source)
    return compiler.compile_grammar(source)


def _first_line(exc: Exception) -> str:
    """xgrammar's messages start with a timestamp and source location: keep what a user can act on."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def _read_frame_blocking(pipe) -> bytes:
    head = pipe.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError
    size = _LEN.unpack(head)[0]
    data = pipe.read(size)
    if len(data) < size:
        raise EOFError
    return data


if __name__ == "__main__":
    _worker_main()
