"""What the engine hands back per request and step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdcluster.services.token_logprob import TokenLogprob
from pdcluster.services.engine.request import FinishReason

if TYPE_CHECKING:
    from pdcluster.services.engine.kv_tier_stats import TierStats


@dataclass(frozen=True)
class PrefillResult:
    """A prefill-only request's hand-off: its blocks stay pinned under the
    lease ``lease_id`` (== request id) until released or expired."""
    first_token_id: int
    block_ids: tuple[int, ...]
    num_tokens: int          # prompt tokens whose K/V the blocks hold (a resumed request's prior output follows)
    num_cached_tokens: int   # of those, found in the prefix cache
    # time.time() from which the owner refuses reads of block_ids (0 = unknown:
    # treat as expired); the blocks stay unrecycled EXPIRY_GRACE_S longer.
    lease_deadline_unix: float = 0.0


@dataclass(frozen=True)
class ExternalKVAllocation:
    """Blocks reserved for a prompt whose K/V arrives from outside.
    ``block_ids[:num_cached_blocks]`` already hold it (local prefix hit);
    the caller fills the rest, then commits."""
    request_id: str
    block_ids: tuple[int, ...]
    num_cached_blocks: int

    @property
    def missing_block_ids(self) -> tuple[int, ...]:
        return self.block_ids[self.num_cached_blocks:]


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    prefill: PrefillResult | None = None
    first_scheduled_s: float | None = None  # time.monotonic() of its first scheduled step
    # Set on a request the engine failed (finished, finish_reason ABORT): the
    # message of the RequestFailedError that AsyncEngine raises in its stream.
    error: str | None = None
    # With SamplingParams.logprobs: one per new token; with prompt_logprobs, on the first token's
    # output: entry j scores prompt token j+1 (pdcluster/services/engine/logprobs.py).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    # Speculative decoding, so far in this request: tokens drafted, and those accepted
    # (a span attribute's worth; both 0 without drafts).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    def followed_by(self, later: "RequestOutput") -> "RequestOutput":
        """This output and the next one of the same request as one."""
        return RequestOutput(
            self.request_id, self.new_token_ids + later.new_token_ids, self.text_delta + later.text_delta,
            later.finished, later.finish_reason, later.num_prompt_tokens, later.num_cached_tokens,
            later.num_output_tokens, self.prefill or later.prefill,
            self.first_scheduled_s if self.first_scheduled_s is not None else later.first_scheduled_s,
            later.error, _joined(self.logprobs, later.logprobs),
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            later.num_draft_tokens, later.num_accepted_draft_tokens)


def _joined(a: list | None, b: list | None) -> list | None:
    return b if a is None else a if b is None else a + b


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_awaiting_kv: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    leased_blocks: int
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    num_preemptions: int
    num_steps: int
    num_failed_requests: int = 0        # failed alone (bad logits, or in a step that raised)
    num_failed_steps: int = 0           # steps that raised and were recovered from
    num_expired_reservations: int = 0   # reserve_external blocks whose K/V never came within the TTL
    num_refused_reads: int = 0          # lease reads refused (unknown, released or expired lease)
    quarantined_blocks: int = 0         # held out of reuse: a transfer into them is not confirmed stopped
    tenant_kv_blocks: dict[str, int] = field(default_factory=dict)  # blocks in use or cached, per tenant (top 16)
    # Speculative decoding (spec_decode.py): drafted tokens, those accepted, the
    # request-steps that verified a draft and the tokens those steps emitted.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    spec_emitted_tokens: int = 0
    kv_tiers: TierStats | None = None  # when the engine has tiers under its pool (kv_tiers.py)

    @property
    def spec_tokens_per_step(self) -> float | None:
        """Tokens a drafted request-step emitted on average (1 = no gain); None before any."""
        return self.spec_emitted_tokens / self.spec_verify_steps if self.spec_verify_steps else None
