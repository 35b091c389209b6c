"""N-gram prompt lookup: the draft for speculative decoding, without a draft model.

Text that copies its context (code edits, summaries quoting their source,
repeated structure) continues the way it did the last time its latest few
tokens appeared.  So: take the sequence's last n tokens, find their latest
earlier occurrence, and propose the k tokens that followed it::

    tokens    ... a b c d e ... x y a b c | <- the suffix "a b c" (n = 3)
                  ^^^^^ latest earlier match
    proposal        d e ...  (at most k tokens, never past the suffix's start)

n runs from ``ngram_max`` down to ``ngram_min``: a longer match is better
evidence.  A pure function of the token ids; the caller decides when to ask.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcluster.services.engine.request import Request


def propose_ngram(token_ids: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n from ``ngram_max`` down to ``ngram_min``);
    [] when no suffix of those lengths occurred before."""
    total = len(token_ids)
    if k < 1 or total < ngram_min + 1:
        return []
    rev = list(token_ids)[::-1]  # rev[j] is the token j places before the last
    cap = min(ngram_max, total - 1)
    best_len, best_end = 0, 0
    j = 0
    while best_len < cap:
        try:
            j = rev.index(rev[0], j + 1)  # the next earlier occurrence of the last token (a C-speed scan)
        except ValueError:
            break
        length = 1
        while length < cap and j + length < total and rev[j + length] == rev[length]:
            length += 1
        if length > best_len:  # candidates come latest first: a tie keeps the later one
            best_len, best_end = length, total - j
    if best_len < ngram_min:
        return []
    return list(token_ids[best_end:best_end + k])


class NgramProposer:
    """spec_decode.Proposer by prompt lookup: stateless, nothing to release."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, req: Request, k: int) -> list[int]:
        return propose_ngram(req.all_token_ids, k, self.ngram_min, self.ngram_max)

    def release(self, request_id: str) -> None:
        pass
