"""One draw from a row of probabilities (a sampled token, a speculative draft's
verification): the inverse of its cumulative sum at one uniform number from the
request's generator.

torch.multinomial took 0.88 ms a row of the default model's 49,152 tokens, and
its validity check another 0.1 ms (one thread, Sapphire Rapids): sixteen sampled
streams spent 16 ms of every decode step there, more than half the step.  The
cumulative sum (float64, so a vocabulary's worth of small probabilities adds up
exactly enough) and one binary search take 0.05 ms, and the sum's last entry is
the validity check: a NaN or an infinity anywhere reaches it."""

from __future__ import annotations

import math

import torch


def draw(probs: torch.Tensor, generator: torch.Generator) -> int | None:
    """Index i of the 1-D ``probs`` with probability probs[i] / probs.sum(), from one
    uniform number of ``generator``; None when the row has no valid mass (a NaN or an
    infinity in it, or nothing above zero).  An index of zero mass is never drawn."""
    cdf = probs.double().cumsum(0)
    total = float(cdf[-1])
    if not (math.isfinite(total) and total > 0):
        return None
    u = torch.rand((), dtype=torch.float64, generator=generator) * total
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= probs.numel():  # u rounded up to the total: the last index with mass
        i = int(torch.nonzero(probs > 0)[-1])
    return i
