"""Speculative decoding: who gets a draft this step, how it is checked, and
when a request stops getting one.  Where the draft comes from is a
``Proposer``'s business: n-gram prompt lookup (spec_ngram.py) or a draft
model (spec_draft.py); everything here is the same for both.

One step of a request with a draft d1..dk (k <= ``num_tokens``)::

    fed (one query of k+1 tokens over the request's cached K/V, in the step's one forward)
        positions  n-1   n    n+1  ..  n+k-1          (n = num_tokens; n-1 = its last token)
        tokens     t     d1   d2   ..  dk
        logits     p0    p1   p2   ..  pk             p_j: the target's next-token distribution
    chosen         y0    y1   y2   ..  yk             y_j = argmax p_j, or a draw from p_j
    emitted        y0 .. y_a, a = the first j with y_j != d_(j+1) (or k): the accepted drafts + one more

K/V is written for all k+1 positions; only the first a+1 (t, d1..da) are
kept: ``num_computed_tokens`` grows by a+1 and the blocks past it go back
(scheduler.update).  Output is the target's exactly: greedy ``y_j`` is what
plain decoding would have chosen after the same tokens.  Sampling draws
``y_j`` from p_j with the generator of output position len(output)+j
(random_stream.py) and accepts d iff y == d -- that is rejection sampling
with a point-mass proposal (accept d with probability p(d); on rejection
the token is distributed as p with d removed, renormalised), and it draws
exactly what plain decoding draws, so a seeded request's output does not
depend on speculation at all.

Who is never drafted for: requests with a grammar (the mask depends on
every accepted token), with penalties, ``logit_bias`` or ``min_tokens``
(their logits depend on the output so far, row by row), prefill-only ones.

Back-off: per request, acceptance is counted over windows of
``window_tokens`` proposed tokens; a window below ``min_acceptance`` stops
drafting for ``BACKOFF_STEPS`` steps, doubling for each window in a row that
fails (up to ``BACKOFF_MAX_STEPS``), so text that does not repeat itself
pays for a few rejected drafts, then nearly nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdcluster.services.engine.categorical import draw
from pdcluster.services.engine.config import SpeculativeConfig
from pdcluster.services.engine.request import Request
from pdcluster.services.engine.spec_ngram import NgramProposer

BACKOFF_STEPS = 16
BACKOFF_MAX_STEPS = 256


def emitted_tokens(chosen: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The tokens a verified step emits: ``chosen[j]`` is the target's token
    after draft position j (``len(draft) + 1`` of them); the drafts it agrees
    with, then the first it does not (or the bonus token after all k)."""
    out: list[int] = []
    for j, token in enumerate(chosen):
        out.append(token)
        if j >= len(draft) or token != draft[j]:
            break
    return out


def verify_sampled(probs: Callable[[int], torch.Tensor], draft: Sequence[int],
                   generator: Callable[[int], torch.Generator]) -> list[int]:
    """Point-mass rejection sampling of one request's draft: ``probs(j)`` is
    the target distribution after draft position j, ``generator(j)`` the
    generator for that draw.  Draws lazily: rows past the first rejection
    cost nothing."""
    out: list[int] = []
    for j in range(len(draft) + 1):
        token = draw(probs(j), generator(j))
        if token is None:
            raise RuntimeError("the target distribution has no valid mass")
        out.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return out


def speculates(req: Request) -> bool:
    """Whether the request may get drafts at all (module docstring)."""
    p = req.params
    return p.guided is None and not p.adjusts_logits and not req.prefill_only


@dataclass
class _Window:
    proposed: int = 0
    accepted: int = 0
    skip_steps: int = 0     # steps left without a draft
    failed_windows: int = 0  # in a row
    total_proposed: int = 0  # over the request's life
    total_accepted: int = 0


class Proposer(Protocol):
    """Where drafts come from.  ``propose`` returns at most ``k`` tokens to
    follow ``req.all_token_ids`` ([] for none); ``release`` drops whatever
    the proposer keeps for a request (it ended, was aborted or preempted):
    a later ``propose`` for the same id starts from nothing."""

    def propose(self, req: Request, k: int) -> list[int]: ...

    def release(self, request_id: str) -> None: ...


class Speculator:
    """Asks its proposer for drafts, counts acceptance, backs off."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None):
        self.config = config
        self.proposer = proposer or NgramProposer(config.ngram_min, config.ngram_max)
        self._windows: dict[str, _Window] = {}
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0      # request-steps that verified a draft
        self.num_emitted_tokens = 0    # tokens those steps emitted (accepted + one each)
        self.num_backoffs = 0

    def propose(self, req: Request, budget: int) -> list[int]:
        """A draft for ``req``'s next step ([] for none): at most
        ``num_tokens``, ``budget`` and what max_tokens leaves after the one
        token every step emits anyway."""
        if not speculates(req):
            return []
        w = self._windows.setdefault(req.request_id, _Window())
        if w.skip_steps:
            w.skip_steps -= 1
            return []
        k = min(self.config.num_tokens, budget, req.params.max_tokens - len(req.output_token_ids) - 1)
        if k < 1:
            return []
        return self.proposer.propose(req, k)

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """One verified step's outcome; closes the request's window when full."""
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_verify_steps += 1
        self.num_emitted_tokens += num_accepted + 1
        w = self._windows.setdefault(request_id, _Window())
        w.proposed += num_proposed
        w.accepted += num_accepted
        w.total_proposed += num_proposed
        w.total_accepted += num_accepted
        if w.proposed < self.config.window_tokens:
            return
        if w.accepted < self.config.min_acceptance * w.proposed:
            w.failed_windows += 1
            w.skip_steps = min(BACKOFF_STEPS << (w.failed_windows - 1), BACKOFF_MAX_STEPS)
            self.num_backoffs += 1
        else:
            w.failed_windows = 0
        w.proposed = w.accepted = 0

    def totals(self, request_id: str) -> tuple[int, int]:
        """(drafted, accepted) tokens of the request so far."""
        w = self._windows.get(request_id)
        return (w.total_proposed, w.total_accepted) if w else (0, 0)

    def preempted(self, request_id: str) -> None:
        """The request lost its K/V (it will be recomputed): its proposer
        state goes too; its acceptance window stays (same text, same odds)."""
        self.proposer.release(request_id)

    def forget(self, request_id: str) -> None:
        self._windows.pop(request_id, None)
        self.proposer.release(request_id)
