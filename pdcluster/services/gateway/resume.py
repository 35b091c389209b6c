"""What the gateway keeps per stream so another replica can continue it,
and the message that resumes it there.

    sent to the client:   [ t0 (prefill) | t1 ... tk (decode replica A) ]   A dies
    resume on replica B:  GenerateRequest(prompt, params, prior_output_token_ids = t0..tk)
    B streams:            t(k+1) ...     (never t0..tk again: usage counts each token once)

The prior tokens travel as output, not prompt, so max_tokens, min_tokens,
penalties, stop strings, the detokenizer and the seeded random stream all
continue where the original was (pdcluster/services/engine/output_history.py).  A
sampled request without a seed gets one here, before its first hop
(``with_stream_seed``): its draws are still fresh per request, and a resumed
hop draws what the lost replica would have (pdcluster/services/engine/random_stream.py).  The
request id stays the client's, with a suffix per hop so the new replica
never meets the old id (a replica that only stalled may still hold it)."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from pdcluster.services.messages import GenerateRequest, StreamDraw, TokenDelta


@dataclass
class StreamProgress:
    """One stream, as the client has seen it so far."""
    num_prompt_tokens: int
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)   # every token sent, in order
    replica: str = ""                                     # the replica streaming now (TokenDelta.streamed_by)
    lost: list[str] = field(default_factory=list)         # "reason@replica" per failover, in order
    lost_replicas: list[str] = field(default_factory=list)

    def add(self, chunk: TokenDelta) -> None:
        self.token_ids.extend(chunk.token_ids)

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - len(self.token_ids)

    @property
    def num_failovers(self) -> int:
        return len(self.lost)

    def failed_over(self, reason: str, replica: str, avoid: bool) -> None:
        """Notes a loss; ``avoid``: the resumed attempt must not go back to ``replica``."""
        self.lost.append(f"{reason}@{replica or '?'}")
        if replica and avoid and replica not in self.lost_replicas:
            self.lost_replicas.append(replica)
        self.replica = ""


def resume_request(req: GenerateRequest, progress: StreamProgress) -> GenerateRequest:
    """The whole-request message that continues ``req`` after ``progress``,
    routed by the prompt's prefix (the index says who holds it) with the
    tokens still to come, and kept off the replicas it lost."""
    routing = dataclasses.replace(req.routing, max_new_tokens=max(progress.tokens_left, 0), prefer_worker=None,
                                  avoid_workers=tuple(progress.lost_replicas))
    return dataclasses.replace(req, request_id=f"{req.request_id}~r{progress.num_failovers}", routing=routing,
                               prior_output_token_ids=tuple(progress.token_ids), handoff=None)


def with_stream_seed(req: GenerateRequest, draw: Callable[[int], int] = secrets.randbits) -> GenerateRequest:
    """``req`` with a seed of its own when it samples without one (greedy and
    seeded requests unchanged)."""
    if req.draw.seed is not None or req.params.greedy:
        return req
    return dataclasses.replace(req, own_draw=StreamDraw(draw(63), req.draw.prompt_logprobs))
