"""A resumed request's output history: the tokens another replica already
generated (and the client already has), carried in as OUTPUT, not prompt.

Why not append them to the prompt: everything that reads "the output" would
then miss them -- frequency/presence penalties count output tokens only,
min_tokens and max_tokens count output tokens, stop strings are matched on
the output text, and the seeded random stream is indexed by output
position.  So the request keeps its original prompt, and its output starts
as the prior tokens::

    |<------------- num_tokens -------------->|
    [ prompt ........ | prior output ........ ]  new tokens go here ->
    |<-- K/V recomputed at admission (minus prefix-cache hits) -->|

The scheduler already handles a waiting request that has outputs (that is
what preemption by recompute leaves behind): it computes prompt + outputs
and samples the next token.  The detokenizer replays the prior tokens, so
its state -- offsets, held-back text, stop-string matches -- is exactly the
original's after them, and the text deltas that follow concatenate to the
uninterrupted text."""

from __future__ import annotations

from collections.abc import Sequence

from pdcluster.services.engine.detokenizer import IncrementalDetokenizer
from pdcluster.services.engine_errors import InvalidRequestError


def check_prior_output(prior: Sequence[int], max_tokens: int, vocab_size: int) -> None:
    """Raises InvalidRequestError naming the fix if ``prior`` cannot resume a request."""
    if len(prior) >= max_tokens:
        raise InvalidRequestError(f"the resumed request already has {len(prior)} output tokens and max_tokens is "
                                  f"{max_tokens}: nothing is left to generate")
    bad = next((t for t in prior if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"prior output token id {bad!r} is outside this model's vocabulary "
                                  f"[0, {vocab_size})")


def replay_prior_output(detok: IncrementalDetokenizer, prior: Sequence[int], ignore_eos: bool,
                        eos_token_ids: Sequence[int]) -> None:
    """Replays ``prior`` through ``detok`` the way post-processing would have
    (EOS adds no text unless ignore_eos), discarding the text: the client
    already has it.  The request itself gets ``prior`` as its first output
    tokens from ``Scheduler.add``."""
    for token in prior:
        if ignore_eos or token not in eos_token_ids:
            detok.add(token)
