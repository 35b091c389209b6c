"""One request's state inside the engine, with its named counters.

Token regions of a request (prompt then outputs)::

    |<---------------- num_tokens ---------------->|
    [ prompt tokens ........ | output tokens ...... ]
    |<-- num_computed_tokens -->|                        K/V in the pool
    |<- num_cached_tokens ->|                            prefix-cache hit at admission

Invariant: 0 <= num_cached_tokens <= num_computed_tokens <= num_tokens, and
the block table covers at least num_computed_tokens.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdcluster.services.sampling_params import SamplingParams, StreamDraw


class RequestStatus(enum.Enum):
    WAITING = "waiting"            # not admitted, or preempted
    WAITING_FOR_KV = "waiting_for_kv"  # blocks allocated, KV arriving from outside
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, stop token or stop string
    LENGTH = "length"      # max_tokens or the model's context
    ABORT = "abort"
    PREFILLED = "prefilled"  # prefill-only request: first token out, blocks leased


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = field(default_factory=time.monotonic)
    prefill_only: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, in order
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    fair_tag: float = 0.0  # start tag among its tenant's and the others' (fair_queue.py), set when queued
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    # With draw.prompt_logprobs: entry j scores prompt token j+1 (logprobs.py), filled chunk by chunk.
    prompt_logprobs: list = field(default_factory=list)
    # With params.guided: its compiled grammar, compiled off the engine thread before the request
    # came in (grammar.py); held here so the grammar cache's eviction never reaches a live request.
    grammar: Any = None
    # The seed it draws with and the prompt logprobs it reports (StreamDraw): params' unless
    # the gateway gave this stream its own (choice k of n, a gateway-drawn seed).
    draw: StreamDraw | None = None

    def __post_init__(self) -> None:
        if self.draw is None:
            self.draw = StreamDraw.of(self.params)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_invariants(self, block_size: int) -> None:
        assert 0 <= self.num_cached_tokens <= self.num_computed_tokens <= self.num_tokens, self
        assert len(self.block_ids) * block_size >= self.num_computed_tokens, self
        assert len(self.block_hashes) <= self.num_tokens // block_size, self
