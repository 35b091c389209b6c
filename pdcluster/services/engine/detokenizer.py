"""Incremental detokenization: text deltas as tokens arrive, never emitting a
half-decoded multi-byte character, and stop-string matching on the text.

Stop strings are matched as the text grows, reading each new character once
(Knuth-Morris-Pratt per stop string): a token costs its characters times the
number of stop strings, however long the text and the strings (up to
MAX_STOP_STRINGS of MAX_STOP_STRING_CHARS).  The same state says how much of
the text's tail could still start a stop string, which is held back::

    text: [ emitted ............ | held: a prefix of some stop string ]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from pdcluster.services.tokenizer import Tokenizer

# A character is at most 4 bytes: a longer run of tokens that still ends in
# an incomplete one is emitted as is (with U+FFFD), not decoded again forever.
_MAX_PENDING_TOKENS = 8


@functools.lru_cache(maxsize=1024)
def _failure(s: str) -> tuple[int, ...]:
    """KMP: for each prefix s[:i+1], the length of its longest proper prefix that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: its longest prefix that ends the text read so far
        self._none_matched = list(self._matched)
        self._alphabet = frozenset("".join(self.stops))

    def feed(self, text: str, start: int) -> int | None:
        """Reads ``text[start:]`` (the characters added since the last call);
        returns where the first stop string completed in it begins, or None."""
        matched, stops, fails = self._matched, self.stops, self._fail
        for pos in range(start, len(text)):
            c = text[pos]
            if c not in self._alphabet:  # no stop string can continue through c
                matched[:] = self._none_matched
                continue
            done = 0  # the longest stop string completed here (the earliest start among them)
            for j, s in enumerate(stops):
                k = matched[j]
                while k and s[k] != c:
                    k = fails[j][k - 1]
                if s[k] == c:
                    k += 1
                if k == len(s):
                    done, k = max(done, k), fails[j][k - 1]
                matched[j] = k
            if done:
                return pos + 1 - done
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the text that could start a stop string."""
        return max(self._matched, default=0)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._stops = StopMatcher(self.stop) if self.stop else None
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
        start = len(self.text)
        prefix = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(ids[self._prefix_offset:])
        complete = not full.endswith("\ufffd") and len(full) > len(prefix)
        if complete or len(ids) - self._read_offset >= _MAX_PENDING_TOKENS:
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
        return self._flush_stop_safe(start)

    def _flush_stop_safe(self, start: int) -> str:
        """Hands out text from ``start`` on, holding back a tail that might
        start a stop string."""
        if self.stopped:
            return ""
        if self._stops is None:
            return self._take(len(self.text))
        cut = self._stops.feed(self.text, start)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            return self._take(cut)
        return self._take(len(self.text) - self._stops.held)

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
