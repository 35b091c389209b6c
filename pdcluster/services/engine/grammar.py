"""Compiled grammars, one per distinct ``GuidedSpec``, over this engine's
own tokenizer (xgrammar).

Compiling is the expensive part of structured output (~10 ms for a small
JSON schema over a 49k vocabulary, seconds for a big one), so:

- it never runs on the engine thread: ``AsyncEngine`` awaits
  ``compile_future`` at admission and hands the compiled grammar to the
  engine with the request (``Request.grammar``); the engine and the sampler
  only read it.  A live request holds its own grammar, so the LRU below may
  evict it without the request noticing: nothing is ever recompiled on the
  engine thread (a resumed request goes through admission again), and a
  compile asked for on that thread raises instead of stalling it;

      admission (event loop)        compile thread (N)         worker process (N)
      await compile_future(spec) -> _run: pool.compile   ->   compile + serialise
                                    deserialize_json     <-   (killed at the limit)
      engine.add_request(..., grammar=compiled)  -> Request.grammar -> GrammarMatcher

- it runs in a bounded pool of worker processes with a hard limit on each
  compile's CPU seconds (grammar_pool.py says why processes, and why CPU
  time); a spec over the limit is an InvalidRequestError (a 400) naming
  the limit and the setting;
- identical specs compile once: a second caller of a spec being compiled
  waits for that compile (in-flight de-duplication), and a spec that failed
  (refused, or over the limit) fails again at once from a small memo
  instead of taking a worker for the whole limit once more.

The cache is an LRU bounded by entries and by bytes, so many distinct
schemas cannot grow a replica's memory without limit (beyond the grammars
live requests hold).

The tokenizer info is built from the tokenizer the engine already loaded
(from the GGUF or the HF directory, see tokenizer.py): no download, and the
token strings are exactly the ones the model was trained on.  It is built on
first use, so an engine that never sees a structured request never imports
xgrammar nor starts a worker."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.engine.grammar_pool import GrammarCompilePool, GrammarCompileTimeout
from pdcluster.services.guided_spec import GuidedSpec
from pdcluster.services.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
MAX_CACHED_GRAMMAR_BYTES = 256 << 20
MAX_REMEMBERED_FAILURES = 256
# A spec over the limit fails at once for this long (the machine may have been busy): then it may try again.
TIMEOUT_REMEMBERED_S = 60.0
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_COMPILE_WORKERS = 2


def xgrammar_module():
    """xgrammar, imported on first use (it pulls in its native runtime)."""
    import xgrammar

    return xgrammar


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> "xgrammar.TokenizerInfo":
    """xgrammar's view of our tokenizer: token strings, vocabulary type
    (byte-level BPE for SmolLM2) and stop tokens, padded to the model's
    logits width (``vocab_size``; ids past the tokenizer's are never allowed)."""
    xgr = xgrammar_module()
    return xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size,
                                              stop_token_ids=list(tokenizer.eos_token_ids))


def compile_timeout_error(spec: GuidedSpec, timeout_s: float) -> InvalidRequestError:
    return InvalidRequestError(
        f"guided {spec.describe()} did not compile within the {timeout_s:g} s grammar compile limit "
        f"(grammar_compile_timeout_s, CPU seconds): simplify it (fewer anyOf / enum / pattern / nested properties), "
        "or ask the operator to raise grammar_compile_timeout_s")


class GrammarCache:
    """Spec -> compiled grammar, thread-safe (compiles are called from worker threads)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_entries: int = MAX_CACHED_GRAMMARS,
                 max_bytes: int = MAX_CACHED_GRAMMAR_BYTES, compile_workers: int = DEFAULT_COMPILE_WORKERS,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"max_entries and max_bytes must be >= 1, got {max_entries}, {max_bytes}")
        if compile_workers < 1 or not compile_timeout_s > 0:
            raise ValueError(f"compile_workers must be >= 1 and compile_timeout_s > 0, got {compile_workers}, "
                             f"{compile_timeout_s}")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.compile_workers, self.compile_timeout_s = compile_workers, compile_timeout_s
        self._info: Any = None
        self._pool: GrammarCompilePool | None = None
        self._entries: OrderedDict[GuidedSpec, Any] = OrderedDict()
        self._in_flight: dict[GuidedSpec, concurrent.futures.Future] = {}
        self._failed: OrderedDict[GuidedSpec, tuple[InvalidRequestError, float]] = OrderedDict()  # error, until
        self._bytes = 0
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()
        self.num_compiles = 0
        self.num_hits = 0
        self.num_timeouts = 0
        self.num_shared = 0   # callers that waited on another's compile of the same spec
        # One thread per compile worker: a queued compile waits in the executor's queue, not in a thread.
        self._executor = concurrent.futures.ThreadPoolExecutor(compile_workers, thread_name_prefix="grammar-compile")
        # The thread that must never wait on a compile (AsyncEngine's engine thread sets it).
        self.forbidden_thread: threading.Thread | None = None

    def _pool_and_info(self) -> tuple[GrammarCompilePool, Any]:
        with self._setup_lock:
            if self._pool is None:
                self._info = tokenizer_info(self.tokenizer, self.vocab_size)
                self._pool = GrammarCompilePool(self._info.serialize_json(), self.compile_workers)
            return self._pool, self._info

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_token_ids)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: GuidedSpec) -> Any | None:
        """The cached grammar of ``spec``, or None; never compiles."""
        with self._lock:
            compiled = self._entries.get(spec)
            if compiled is not None:
                self._entries.move_to_end(spec)
                self.num_hits += 1
            return compiled

    def compile(self, spec: GuidedSpec) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of ``spec``, blocking until it is (never on
        the engine thread: that raises); InvalidRequestError when the spec
        does not compile or runs past the limit.  See compile_future."""
        if threading.current_thread() is self.forbidden_thread:
            raise RuntimeError(f"a grammar compile ({spec.describe()}) was asked for on the engine thread, where it "
                               "would stall every stream: compile it at admission (AsyncEngine) and pass the grammar in")
        return self.compile_future(spec).result()

    def compile_future(self, spec: GuidedSpec) -> concurrent.futures.Future:
        """A future of the compiled grammar of ``spec``: done at once on a
        cache hit or a remembered failure; the running compile's future when
        the same spec is being compiled (in-flight de-duplication); else a new
        compile queued for the pool.  Waiting on it holds no thread of the
        pool; do not cancel it (other requests may share it)."""
        with self._lock:
            compiled = self._entries.get(spec)
            if compiled is not None:
                self._entries.move_to_end(spec)
                self.num_hits += 1
                return _done(compiled)
            error, until = self._failed.get(spec, (None, 0.0))
            if error is not None and time.monotonic() < until:
                return _done(error=error)
            running = self._in_flight.get(spec)
            if running is not None:
                self.num_shared += 1
                return running
            running = self._in_flight[spec] = concurrent.futures.Future()
        self._executor.submit(self._run, spec, running)
        return running

    def _run(self, spec: GuidedSpec, result: concurrent.futures.Future) -> None:
        """On a compile thread: one compile, its outcome to every waiter."""
        try:
            compiled = self._compile_now(spec)
        except BaseException as exc:  # noqa: BLE001 - every waiter hears of it
            with self._lock:
                del self._in_flight[spec]
            result.set_exception(exc)
            return
        with self._lock:
            del self._in_flight[spec]
            self._insert(spec, compiled)
        result.set_result(compiled)

    def _compile_now(self, spec: GuidedSpec) -> "xgrammar.CompiledGrammar":
        pool, info = self._pool_and_info()
        try:
            outcome = pool.compile(spec.kind, spec.source, self.compile_timeout_s)
        except GrammarCompileTimeout:
            self.num_timeouts += 1
            log.warning("grammar compile over the limit, worker killed: spec=%s limit_s=%g",
                        spec.describe(), self.compile_timeout_s)
            raise self._remember_failure(spec, compile_timeout_error(spec, self.compile_timeout_s),
                                         TIMEOUT_REMEMBERED_S) from None
        if outcome.error is not None:
            raise self._remember_failure(spec, InvalidRequestError(
                f"guided {spec.kind} could not be compiled: {outcome.error}")) from None
        compiled = xgrammar_module().CompiledGrammar.deserialize_json(outcome.compiled_json, info)
        log.info("grammar compiled: spec=%s bytes=%d seconds=%.3f", spec.describe(),
                 int(compiled.memory_size_bytes), outcome.seconds)
        return compiled

    def _remember_failure(self, spec: GuidedSpec, error: InvalidRequestError,
                          for_s: float = float("inf")) -> InvalidRequestError:
        with self._lock:
            self._failed[spec] = (error, time.monotonic() + for_s)
            self._failed.move_to_end(spec)
            while len(self._failed) > MAX_REMEMBERED_FAILURES:
                self._failed.popitem(last=False)
        return error

    def _insert(self, spec: GuidedSpec, compiled: Any) -> None:
        self.num_compiles += 1
        if spec not in self._entries:
            self._entries[spec] = compiled
            self._bytes += int(compiled.memory_size_bytes)
        self._evict()

    def _evict(self) -> None:
        """Oldest first, down to the bounds (the newest entry always stays)."""
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
            _, old = self._entries.popitem(last=False)
            self._bytes -= int(old.memory_size_bytes)

    def close(self) -> None:
        """Stops the compile workers (a later compile starts new ones)."""
        with self._setup_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


def _done(value: Any = None, error: BaseException | None = None) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future
