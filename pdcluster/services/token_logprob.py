"""One token's log-probability as it travels from the engine to the client
(pdcluster/services/engine/logprobs.py computes them; the gateway renders
them, pdcluster/services/openai/logprobs_format.py): plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the likeliest alternatives at its
    position (``top``: (token id, logprob), likeliest first, k of them)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
