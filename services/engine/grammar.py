"""Compiled grammars, one per distinct ``GuidedSpec``, over this engine's
own tokenizer (xgrammar).

Compiling is the expensive part of structured output (~10 ms for a small
JSON schema over a 49k vocabulary, much more for a big one), so it happens
once per distinct spec, at admission and off the engine thread
(``AsyncEngine`` calls ``compile`` in a worker thread before it queues the
request); the engine's own call then hits this cache.  The cache is an LRU
bounded by entries and by bytes, so many distinct schemas cannot grow a
replica's memory without limit.

The tokenizer info is built from the tokenizer the engine already loaded
(from the GGUF or the HF directory, see tokenizer.py): no download, and the
token strings are exactly the ones the model was trained on.  It is built on
first use, so an engine that never sees a structured request never imports
xgrammar."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from services.engine.errors import InvalidRequestError
from services.engine.guided_spec import GuidedSpec
from services.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
MAX_CACHED_GRAMMAR_BYTES = 256 << 20


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


def compile_spec(compiler: "xgrammar.GrammarCompiler", spec: GuidedSpec) -> "xgrammar.CompiledGrammar":
    """The compiled grammar of ``spec``; InvalidRequestError naming the kind
    when the library refuses it (an unsupported schema keyword, a bad regex)."""
    try:
        if spec.kind == "json_schema":
            # Compact separators: with free whitespace a small model can fill
            # max_tokens with newlines and never close the object.  Strict:
            # only the declared properties, which still validates against a
            # schema that allows more.
            return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        return compiler.compile_grammar(spec.source)
    except (RuntimeError, ValueError, TypeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"guided {spec.kind} could not be compiled: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    """xgrammar's messages start with a timestamp and source location: keep what a user can act on."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class GrammarCache:
    """Spec -> compiled grammar, thread-safe (compiles run in worker threads)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_entries: int = MAX_CACHED_GRAMMARS,
                 max_bytes: int = MAX_CACHED_GRAMMAR_BYTES, compile_threads: int = 2):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"max_entries and max_bytes must be >= 1, got {max_entries}, {max_bytes}")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_entries, self.max_bytes, self.compile_threads = max_entries, max_bytes, compile_threads
        self._compiler: Any = None
        self._entries: OrderedDict[GuidedSpec, Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.num_hits = 0

    @property
    def compiler(self) -> "xgrammar.GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                xgr = xgrammar_module()
                # Our LRU is the one cache: xgrammar's own would hold a second copy.
                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.tokenizer, self.vocab_size),
                                                     max_threads=self.compile_threads, cache_enabled=False)
            return self._compiler

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_token_ids)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: GuidedSpec) -> Any | None:
        with self._lock:
            compiled = self._entries.get(spec)
            if compiled is not None:
                self._entries.move_to_end(spec)
                self.num_hits += 1
            return compiled

    def compile(self, spec: GuidedSpec) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of ``spec``, from the cache or compiled now."""
        compiled = self.get(spec)
        if compiled is not None:
            return compiled
        compiled = compile_spec(self.compiler, spec)
        size = int(compiled.memory_size_bytes)
        with self._lock:
            self.num_compiles += 1
            if spec not in self._entries:
                self._entries[spec] = compiled
                self._bytes += size
            self._evict()
        log.info("grammar compiled: spec=%s bytes=%d cached=%d", spec.describe(), size, len(self._entries))
        return compiled

    def _evict(self) -> None:
        """Oldest first, down to the bounds (the newest entry always stays)."""
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
            _, old = self._entries.popitem(last=False)
            self._bytes -= int(old.memory_size_bytes)
