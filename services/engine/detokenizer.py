"""Incremental detokenization: text deltas as tokens arrive, never emitting a
half-decoded multi-byte character, and stop-string matching on the text."""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.tokenizer import Tokenizer

class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0  # characters of self.text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Appends one token; returns the newly final text (may be "").

        The tokens since the last emitted piece are decoded together with the
        piece before them, so merges across the boundary (leading spaces,
        byte-fallback characters) come out right."""
        self.token_ids.append(token_id)
        ids = self.token_ids
        prefix = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(ids[self._prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return self._flush_stop_safe()
        self.text += full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return self._flush_stop_safe()

    def _flush_stop_safe(self) -> str:
        """Hands out text, holding back a tail that might start a stop string."""
        if self.stopped:
            return ""
        for s in self.stop:
            idx = self.text.find(s, max(0, self._emitted - len(s) + 1))
            if idx != -1:
                self.text = self.text[:idx]
                self.stopped = True
                return self._take(len(self.text))
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self._take(len(self.text) - hold)

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted:upto]
        self._emitted = upto
        return out

    def finish(self) -> str:
        """Releases any held-back tail at the end of generation."""
        if self.stopped:
            return ""
        return self._take(len(self.text))
