"""The messages of one request's path, gateway -> router -> replica ->
engine and back (pickled by Ray across each hop; plain dataclasses).

    GenerateRequest   one shape for every call: prefill, decode (``handoff``
                      set), colocated, a resumed stream (``prior_output_token_ids``,
                      on a whole-request call, or on both calls of a hand-off)
    PrefillResponse   the prefill replica's answer: first token + where its KV is
    TokenDelta        one streamed piece, replica -> gateway -> HTTP layer (over
                      the token channel when the call names a ``reply_to``)
    ReplyTo / ChannelDone   the token channel's address and a call's frame count
    LeaseRelease      drop a hand-off's lease on the replica holding it
    PrefixLeaseRequest / PrefixLease   a replica asks a peer to lend a prompt's
                      cached leading blocks (peer prefix fetch, pdcluster/services/pools/peer_fetch.py)

The router reads ``GenerateRequest.routing`` (pdcluster/router/routing_header.py) and
nothing else; the block hashes in it are computed once, at the gateway
(pdcluster/prefix_store/hashing.py), and every engine downstream trusts them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.token_logprob import TokenLogprob
from pdcluster.services.sampling_params import SamplingParams, StreamDraw

if TYPE_CHECKING:
    from pdcluster.services.engine.outputs import RequestOutput


@dataclass(frozen=True)
class PrefillResponse:
    request_id: str
    first_token_id: int
    text: str                      # the first token's text delta
    finish_reason: str | None      # set when the first token already ends the request
    block_ids: tuple[int, ...]     # pinned under lease ``request_id`` unless finished
    num_tokens: int                # prompt tokens whose K/V the blocks hold (then a resumed stream's prior output's)
    num_cached_tokens: int         # of those, prefix-cache hits on the prefill replica
    peer: bytes                    # the prefill replica's transfer descriptor
    worker_name: str
    prefill_s: float
    lease_deadline_unix: float = 0.0  # time.time() after which the owner refuses reads of block_ids
    # one per block_ids entry (pdcluster/transfer/checksum.py): the puller checks them
    block_checksums: tuple[int, ...] = ()
    # The first token is sampled here, so its logprobs (and the prompt's) come from here too.
    logprobs: list[TokenLogprob] | None = None         # the first token's, with params.logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # entry j = prompt token j+1, with params.prompt_logprobs


@dataclass(frozen=True)
class ReplyTo:
    """A gateway's token inbox and the mailbox of one attempt in it (``key``: random, per call)."""
    host: str
    port: int
    inbox: str
    key: str


@dataclass(frozen=True)
class ChannelDone:
    """A streaming call's last item over Serve when its deltas went over the token channel: how
    many frames it sent there (the gateway takes that many before anything Serve says next)."""
    frames: int


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams           # built once, from the HTTP request (pdcluster/services/openai/protocol.py)
    routing: RoutingHeader           # the prompt's block hashes and where this call may go
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C carrier
    faults: tuple[str, ...] = ()     # test-only fault injection (pdcluster/services/pools/faults.py)
    # A resumed stream's tokens already sent (another replica generated them): the engine
    # takes them as the request's output so far, not as prompt (pdcluster/services/gateway/resume.py).
    prior_output_token_ids: tuple[int, ...] = ()
    handoff: PrefillResponse | None = None  # on the decode call: the prefilled prompt's KV and first token
    # This stream's seed and prompt logprobs where they differ from ``params`` (choice k of n,
    # a gateway-drawn seed): data beside the params, which are never rebuilt.  Read ``draw``.
    own_draw: StreamDraw | None = None
    # time.monotonic() when the gateway began reading it (0: unknown): admission measures the
    # TTFT it calibrates with from here, as the client sees it, not from its own decision.
    arrived_at: float = 0.0
    # Where a streaming call sends its deltas instead of yielding each through Serve (the
    # gateway's token inbox, pdcluster/services/gateway/token_inbox.py); None: through Serve.
    reply_to: ReplyTo | None = None

    @property
    def draw(self) -> StreamDraw:
        """The seed this stream draws with and the prompt logprobs it reports."""
        return self.own_draw if self.own_draw is not None else StreamDraw.of(self.params)

    @property
    def block_hashes(self) -> tuple[int, ...]:
        return self.routing.block_hashes

    def span_tags(self) -> dict[str, str | int]:
        """What every stage span of this request carries besides its replica: its tenant and class."""
        return {"request.tenant": self.params.tenant, "request.priority": self.params.priority}


@dataclass(frozen=True)
class TokenDelta:
    """Tokens produced since the previous delta, and their text."""
    token_ids: list[int]
    text: str
    finish_reason: str | None = None      # "stop" | "length" on the last delta
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    index: int = 0                        # the choice it belongs to (n > 1), set by the HTTP layer
    logprobs: list[TokenLogprob] | None = None         # one per token, with params.logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # on a choice's first delta, with params.prompt_logprobs
    worker_name: str = ""          # on a choice's first delta: the replica that prefilled it
    streamed_by: str = ""          # the replica streaming this delta: the one a failover moves away from
    waiting: bool = False          # no tokens: a hand-off waits for a decode seat or KV (see ``waiting_on``)

    @classmethod
    def of_output(cls, out: "RequestOutput", streamed_by: str, worker_name: str = "",
                  num_cached_tokens: int | None = None) -> "TokenDelta":
        """An engine output as the delta a replica streams (the one place this is written).
        ``num_cached_tokens``: a hand-off's decode side reports what the prefill replica found cached."""
        return cls(out.new_token_ids, out.text_delta, out.finish_reason.value if out.finished else None,
                   num_prompt_tokens=out.num_prompt_tokens,
                   num_cached_tokens=out.num_cached_tokens if num_cached_tokens is None else num_cached_tokens,
                   logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs, worker_name=worker_name,
                   streamed_by=streamed_by)

    @classmethod
    def waiting_on(cls, replica: str) -> "TokenDelta":
        """A keep-alive: the stream's hand-off waits in line for a decode seat or KV blocks (bounded
        by its lease), which is no stalled replica; the gateway's inter-token deadline starts again
        from it, and no client ever sees it."""
        return cls([], "", streamed_by=replica, waiting=True)

    @classmethod
    def decoded(cls, token_ids: list[int], text: str, finish_reason: str | None, **fields) -> "TokenDelta":
        """A delta the token channel carried, its fields type-checked (pdcluster/services/delta_wire.py)."""
        return cls(token_ids, text, finish_reason, **fields)

    @classmethod
    def of_prefill(cls, pre: "PrefillResponse") -> "TokenDelta":
        """The prefill replica's first token, as the first delta of a hand-off's stream."""
        return cls([pre.first_token_id], pre.text, pre.finish_reason, num_prompt_tokens=pre.num_tokens,
                   num_cached_tokens=pre.num_cached_tokens, logprobs=pre.logprobs,
                   prompt_logprobs=pre.prompt_logprobs, worker_name=pre.worker_name)


@dataclass(frozen=True)
class LeaseRelease:
    """Drops the lease ``request_id`` holds; ``routing.target_worker`` names the replica."""
    request_id: str
    routing: RoutingHeader


@dataclass(frozen=True)
class PrefixLeaseRequest:
    """Lend blocks ``start``... of this prompt's cached leading blocks under
    lease ``lease_id``; ``routing.target_worker`` names the holder."""
    lease_id: str
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]    # the prompt's full blocks (the holder's pool's hash seed)
    start: int                       # leading blocks the asker holds already
    routing: RoutingHeader


@dataclass(frozen=True)
class PrefixLease:
    """The holder's answer: blocks ``start .. start + len(block_ids)`` of the
    prompt, pinned until the asker's pull notifies (or the lease expires)."""
    lease_id: str
    block_ids: tuple[int, ...]
    block_checksums: tuple[int, ...]   # one per block (pdcluster/transfer/checksum.py): the puller checks them
    lease_deadline_unix: float
    peer: bytes                        # the holder's transfer descriptor
    worker_name: str
