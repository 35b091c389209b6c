"""What crosses process boundaries between gateway, prefill and decode
replicas (pickled by Ray; plain dataclasses, no behaviour)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.logprobs import TokenLogprob
from services.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    trace_context: dict[str, str] = field(default_factory=dict)
    faults: tuple[str, ...] = ()   # test-only fault injection (services/pools/faults.py)
    # A resumed stream's tokens already sent (another replica generated them): the engine
    # takes them as the request's output so far, not as prompt (services/gateway/resume.py).
    prior_output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefillResponse:
    request_id: str
    first_token_id: int
    text: str                      # the first token's text delta
    finish_reason: str | None      # set when the first token already ends the request
    block_ids: tuple[int, ...]     # pinned under lease ``request_id`` unless finished
    num_tokens: int                # prompt tokens whose K/V the blocks hold
    num_cached_tokens: int         # of those, prefix-cache hits on the prefill replica
    peer: bytes                    # the prefill replica's transfer descriptor
    worker_name: str
    prefill_s: float
    lease_deadline_unix: float = 0.0  # time.time() after which the owner refuses reads of block_ids
    # The first token is sampled here, so its logprobs (and the prompt's) come from here too.
    logprobs: list[TokenLogprob] | None = None         # the first token's, with params.logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # entry j = prompt token j+1, with params.prompt_logprobs


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill: PrefillResponse
    trace_context: dict[str, str] = field(default_factory=dict)
    faults: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """One streamed piece from a decode (or colocated) replica."""
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    blocks_pulled: int = 0
    blocks_reused: int = 0
    logprobs: list[TokenLogprob] | None = None         # one per token, with params.logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first delta, with params.prompt_logprobs
    worker_name: str = ""          # the replica that prefilled (set on the first delta of a whole request)
    streamed_by: str = ""          # the replica streaming this delta: the one a failover moves away from
