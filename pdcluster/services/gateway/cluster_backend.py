"""The gateway's Backend over Serve handles: prefill -> KV pull -> decode
(disaggregated), or one colocated pool.

    gateway ──admission (429 when the predicted TTFT breaks the SLO)
       ├──prefill.remote(req)──> prefill replica (router: cache-aware, reads req.routing)
       │  <── first token + pinned blocks + lease deadline + peer descriptor
       ├──stream first token to the client
       ├──decode.generate(req + hand-off)──> decode replica (router: free KV)
       │     pulls missing blocks (NIXL READ), releases the lease, streams tokens
       └──finally, if no decode token came back and no decode call may still be
          pulling (none was made, it was refused, or it ended): prefill.release(lease)
          on the replica that holds it.  A decode call cancelled mid-pull (client
          gone, deadline) releases the lease itself once its pull ended, so no
          release frees blocks a one-sided READ is still reading; the gateway releases
          too once that call ended there (a call cancelled before its replica ran
          it releases nothing itself; a second release is a no-op).

Every request's stream is one loop (relay.py: admission, then its
attempts): the first attempt on the place admission chose, the next ones
resumed elsewhere, each chunk waited for under one timer set to the nearest
of its deadlines (deadlines.py: end-to-end, first token, the gap between
tokens); past one, the calls in flight are cancelled (the replicas abort and
free their blocks) and the client gets 504 or an SSE error event.  A prefill replica that dies before the
hand-off is retried once (the router picks again); replica-side typed
errors keep their HTTP meaning.

A stream that loses its replica after its first token -- the actor died,
its engine died, the stream broke, the pull from the prefill replica
failed, or (with another replica to go to) the inter-token deadline
passed -- fails over: it resumes on another replica from prompt + the
tokens already sent, at most ``max_failovers`` times (the rule is in
failover.py, the resume message in resume.py)::

    client   t0 t1 t2 t3 ........ (pause) ........ t4 t5 ...   one id, one usage
    replica  [prefill][ decode A    ]X  [ decode B: recompute prompt+t0..t3 | t4 t5 ... ]

or, when prompt + t0..t3 is long, through the prefill pool as a fresh long
prompt goes (prefill replica: prompt+t0..t3 -> t4, KV pulled by decode B: t5 ...)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from ray import exceptions as ray_exceptions
from ray.serve.exceptions import BackPressureError

from pdcluster.observability import metrics
from pdcluster.prefix_store.index import PrefixIndex
from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.gateway.cached_prefix import cache_routed_place, cached_tokens
from pdcluster.services.backend import (
    Backend, BackendError, BackendFailure, BackendOverloaded, BackendUnavailable, for_client,
)
from pdcluster.services.gateway.admission import DEFAULT_RULES, Admission, Ticket
from pdcluster.services.gateway.failover import (AVOIDED, RECOMPUTE, FailoverReason, ReplicaLost, ResumeTarget, decide,
                                       decode_call_over, gave_up_message, live_elsewhere, lost_reason, resume_path,
                                       resume_target)
from pdcluster.services.gateway.failover_log import FailoverLog, PendingSpan
from pdcluster.services.gateway.liveness import PoolLiveness
from pdcluster.services.gateway.placement import DECODE, Placement
from pdcluster.services.gateway.relay import StreamRelay
from pdcluster.services.gateway.reply_order import ordered_replies, watch_call
from pdcluster.services.gateway.token_inbox import TokenInbox
from pdcluster.services.gateway.resume import StreamProgress, resume_request
from pdcluster.services.messages import GenerateRequest, LeaseRelease, PrefillResponse, TokenDelta

log = logging.getLogger("pdcluster.gateway")
_REPLICA_DIED = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)
_RELEASE_TIMEOUT_S = 5.0
_RELEASE_WAIT_S = 60.0        # the longest wait for a cancelled decode call to end, its lease's deadline unknown
_HANDOFF_RETRY_S = 0.25       # between offers of a hand-off to a full decode pool
_HANDOFF_LEASE_MARGIN_S = 2.0  # stop offering it this long before its lease runs out
_SEAT_RETRY_FIRST_S, _SEAT_RETRY_MAX_S = 0.05, 0.5  # offers of a request no place had a seat for


def backend_error(exc: BaseException) -> BaseException:
    """The typed error a replica raised, unwrapped from Ray's task error."""
    if isinstance(exc, BackPressureError):
        return for_client(BackendOverloaded("a pool's request queue is full (its max_queue); retry shortly"))
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray_exceptions.RayTaskError) and isinstance(cause, BackendError):
        return cause
    return exc


def seat_retry_delay_s(waits: int) -> float:
    """The pause before offering a request again that no place had a seat for
    (``waits`` offers already refused): 50 ms, doubling, at most 0.5 s."""
    return min(_SEAT_RETRY_FIRST_S * 2 ** min(waits, 8), _SEAT_RETRY_MAX_S)


def prefill_locally(prompt_tokens: int, local_prefill_max_tokens: int) -> bool:
    """Conditional disaggregation: whether the decode replica prefills this prompt itself."""
    return 0 < prompt_tokens <= local_prefill_max_tokens


@dataclasses.dataclass(frozen=True)
class Call:
    """A streaming call to a replica: Serve's handle and the task that reads it (done once the call
    ended on its replica)."""
    stream: Any
    watcher: asyncio.Task


def _reached_a_replica(stream: Any) -> bool:
    """Whether Serve assigned the call to a replica (True when it cannot tell):
    one cancelled before assignment never ran anywhere.  Reads the handle's
    assignment future, which ``cancel()`` cancels only while unassigned."""
    assignment = getattr(stream, "_replica_result_future", None)
    if assignment is None:
        return True
    return not (assignment.done() and assignment.cancelled())


class ClusterBackend(Backend):
    def __init__(self, handles: dict[str, Any], *, mode: str, model_name: str, max_model_len: int,
                 block_size: int, liveness: PoolLiveness | None = None, fallback_to_colocated: bool = False,
                 local_prefill_max_tokens: int = 0, admission: Admission | None = None,
                 request_timeout_s: float = 300.0, inter_token_timeout_s: float = 30.0,
                 max_failovers: int = 2, failovers: FailoverLog | None = None, resume_local_max_tokens: int = 512,
                 handoff_wait_s: float = 30.0, first_token_timeout_s: float = math.inf,
                 prefix_index: PrefixIndex | None = None, prefill_policy: str = "cache_aware",
                 inbox: TokenInbox | None = None):
        self.handles = handles
        self.inbox = inbox  # where the replicas send streamed deltas (None: through Serve)
        self.max_failovers = max_failovers
        # A resumed stream with more tokens to prefill again than this goes through the prefill pool.
        self.resume_local_max_tokens = resume_local_max_tokens
        self.failovers = failovers or FailoverLog()
        # Built without one (tests, tools): no refusals, and the prefill pool prefills while it lives.
        self.admission = admission or Admission(ttft_slo_s=float("inf"), max_in_flight=1 << 30, shed=False,
                                                rules=dataclasses.replace(DEFAULT_RULES, max_local_prefill_s=0.0))
        self.request_timeout_s, self.inter_token_timeout_s = request_timeout_s, inter_token_timeout_s
        self.first_token_timeout_s = first_token_timeout_s  # raised to 3x a request's predicted TTFT when longer
        self.num_lease_releases = 0
        self.num_handoff_waits = 0
        self.num_seat_waits = 0  # offers of an admitted request that no place had a seat for yet
        self.handoff_wait_s = handoff_wait_s  # longest wait for a decode seat after the first token went out
        self._background: set[asyncio.Task] = set()
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.num_local_prefills = 0
        self.liveness = liveness
        self.fallback_to_colocated = fallback_to_colocated
        self.num_colocated_fallbacks = 0
        self.mode = mode
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.prefill_retries = 0
        # admission counts a prompt's work less what the index says the cache-routed place holds
        self.prefix_index = prefix_index
        self.cache_routed = cache_routed_place(mode, prefill_policy)

    def _prefill_at_zero(self) -> bool:
        """The prefill pool is scaled to zero on purpose (pdcluster/services/pools/pool_targets.py), as of the
        last read."""
        return self.liveness is not None and self.liveness.cached_scaled_to_zero("prefill")

    async def admit(self, req: GenerateRequest) -> Ticket:
        """Where the prompt is prefilled (admission's placement), or 429."""
        num_tokens = len(req.prompt_token_ids)
        who = {"tenant": req.params.tenant, "priority": req.params.priority, "arrived_at": req.arrived_at}
        decode_live = await self._live_count("colocated" if self.mode == "colocated" else "decode")
        # the operator's fixed rule, if set, prefills short prompts on the decode replica
        local = self.mode == "colocated" or prefill_locally(num_tokens, self.local_prefill_max_tokens)
        prefill_live = 0 if local else await self._prefill_live()
        self._adopt_startup_profile()
        cached = await cached_tokens(self.prefix_index, req.routing.block_hashes, self.block_size, self.cache_routed,
                                     decode_live)
        return self.admission.place(num_tokens, prefill_live, decode_live, **who, cached=cached)

    def _adopt_startup_profile(self) -> None:
        """Admission's prefill line from the replicas' start-up measurement, before its first
        sample (Admission.adopt_prefill): the prefill pool's, else the decode (or colocated) pool's;
        and its decode step line from the pool that decodes (Admission.adopt_step)."""
        if self.liveness is None:
            return
        decodes = "colocated" if self.mode == "colocated" else "decode"
        if self.admission.may_adopt_step:
            self.admission.adopt_step(self.liveness.decode_step_s(decodes))
        if not self.admission.may_adopt_prefill:
            return
        for role in ("colocated",) if self.mode == "colocated" else ("prefill", "decode"):
            line = self.liveness.prefill_line(role)
            if line and self.admission.adopt_prefill(*line):
                return

    async def _prefill_live(self) -> int | None:
        """Live prefill replicas; 0 when the pool is scaled to zero or has none alive; None when unknown."""
        if self.liveness is None:
            return None
        if await self.liveness.scaled_to_zero("prefill"):
            return 0
        return await self.liveness.live("prefill")

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Admission, then the stream on its place, failing over when it loses its replica, under the
        deadlines: one loop (relay.py)."""
        return StreamRelay(self, req).chunks()

    async def resume(self, req: GenerateRequest, progress: StreamProgress, lost: ReplicaLost,
                     pending: PendingSpan | None) -> tuple[AsyncIterator[TokenDelta], PendingSpan]:
        """The attempt that continues a stream that lost its replica (at most ``max_failovers`` times),
        and its failover's span; raises the loss's error where the stream does not resume."""
        if pending is not None:
            self.failovers.span(pending, req.trace_context, "", error=lost)
        target = await self._failover_target(req, progress, lost)  # raises when it cannot
        pending = self.failovers.resumed_on(req.request_id, lost.reason.value, lost.replica, target.pool,
                                            progress.num_failovers + 1, len(progress.token_ids), target.path)
        progress.failed_over(lost.reason.value, lost.replica, avoid=lost.reason in AVOIDED)
        return self._resume(req, progress, target, pending), pending

    def resumed(self, pending: PendingSpan, req: GenerateRequest, replica: str) -> None:
        """A resumed stream's new replica sent its first token: the failover's span ends."""
        self.failovers.span(pending, req.trace_context, replica)

    async def _failover_target(self, req: GenerateRequest, progress: StreamProgress,
                               lost: ReplicaLost) -> ResumeTarget:
        """Where the stream resumes; raises the loss's error when it does not."""
        lost.replica = lost.replica or progress.replica
        pool = "colocated" if self.mode == "colocated" else "decode"
        avoided = set(progress.lost_replicas) | ({lost.replica} if lost.replica and lost.reason in AVOIDED else set())
        elsewhere = live_elsewhere(await self._live_count(pool), len(avoided))
        decision = decide(lost.reason, progress.num_failovers, self.max_failovers, progress.tokens_left, elsewhere)
        if not decision.resume:
            self.failovers.gave_up_on(req.request_id, lost.reason.value, lost.replica, decision.why)
            if lost.reason is FailoverReason.INTER_TOKEN_DEADLINE or progress.num_failovers == 0:
                raise lost.final_error() from lost  # as without failover: the loss's own error
            raise for_client(BackendFailure(gave_up_message(lost, decision.why, tuple(progress.lost)))) from lost
        prefill_live = await self._live_count("prefill") if self.mode != "colocated" else None
        target = resume_target(self.mode, elsewhere, prefill_live, self.fallback_to_colocated)
        num_tokens = len(req.prompt_token_ids) + len(progress.token_ids)  # to prefill again
        return resume_path(target, num_tokens, self.resume_local_max_tokens, prefill_live, elsewhere, lost.reason)

    async def _live_count(self, pool: str) -> int | None:
        if self.liveness is None or pool not in self.handles:
            return None
        return await self.liveness.live(pool)

    async def _resume(self, req: GenerateRequest, progress: StreamProgress, target: ResumeTarget,
                      pending: PendingSpan) -> AsyncIterator[TokenDelta]:
        """Continues ``req`` on a replica of ``target.pool`` from prompt + the
        tokens already sent: recomputed there, or prefilled by the prefill
        pool and handed off (``target.via_prefill_pool``)."""
        message = resume_request(req, progress)
        if target.via_prefill_pool:
            chunks = self._resume_via_prefill_pool(message, progress, pending)
        else:
            chunks = self._relay(target.pool, target.method, message, progress)
        async with aclosing(chunks):  # closed with this attempt, not when collected
            async for chunk in chunks:
                # The prompt's logprobs went out with the first attempt's first chunk.
                yield chunk if chunk.prompt_logprobs is None else dataclasses.replace(chunk, prompt_logprobs=None)

    async def _resume_via_prefill_pool(self, message: GenerateRequest, progress: StreamProgress,
                                       pending: PendingSpan) -> AsyncIterator[TokenDelta]:
        """The hand-off path of a fresh request, for prompt + tokens sent.  A
        prefill pool that cannot take it (no replica answers, a full queue)
        costs the stream a recompute on the decode pool, never an error."""
        try:
            pre = await self._prefill(message)
        except (BackendFailure, BackendOverloaded, BackendUnavailable) as exc:
            log.warning("failover of %s: the prefill pool could not prefill the remainder (%s); recomputing it "
                        "on the decode pool", message.request_id, exc)
            pending.path = RECOMPUTE
            async with aclosing(self._relay("decode", "generate_colocated", message, progress)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        async with aclosing(self._decode_handoff(message, pre, progress)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def first_attempt(self, req: GenerateRequest, placement: Placement,
                            progress: StreamProgress | None = None) -> AsyncIterator[TokenDelta]:
        """The request on its place.  Admission already predicted it within
        the SLO, so a full queue before its first token (every place it can
        go to refused a seat: Serve's max_queue, a replica's in-flight
        limit, no free KV) is a wait, not a 429: it is offered again until
        it is taken or its first-token deadline passes (then 504)."""
        waits = 0
        while True:
            sent = False
            try:
                async with aclosing(self._on_place(req, placement, progress)) as chunks:  # closed with us
                    async for chunk in chunks:
                        sent = True
                        yield chunk
                return
            except BackendOverloaded:
                if sent:
                    raise
            metrics.count_seat_wait(self.mode if self.mode == "colocated" else placement.pool or DECODE)
            self.num_seat_waits += 1
            await asyncio.sleep(seat_retry_delay_s(waits))
            waits += 1

    def _on_place(self, req: GenerateRequest, placement: Placement,
                  progress: StreamProgress | None = None) -> AsyncIterator[TokenDelta]:
        """One offer of the request to its place (the decode pool when the prefill pool cannot take it)."""
        if self.mode == "colocated":
            return self._whole_request("colocated", "generate", req, progress)
        if placement.pool == DECODE:
            return self._on_decode(req, placement.reason, progress)
        return self._prefill_then_hand_off(req, progress)

    async def _prefill_then_hand_off(self, req: GenerateRequest,
                                     progress: StreamProgress | None) -> AsyncIterator[TokenDelta]:
        """Prefill on the prefill pool, then the hand-off to a decode replica."""
        try:
            pre = await self._prefill(req)
        except (BackendFailure, BackendOverloaded, BackendUnavailable) as exc:
            # Nothing was sent yet: the decode replica can prefill it (a dead prefill pool is not a lost request).
            log.warning("prefill of %s failed before its first token (%s); the decode pool prefills it",
                        req.request_id, exc)
            async with aclosing(self._on_decode(req, "prefill_failed", progress)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        # Closed with this generator (the client left): its lease release must not wait for GC.
        async with aclosing(self._decode_handoff(req, pre, progress)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _on_decode(self, req: GenerateRequest, reason: str, progress: StreamProgress | None
                   ) -> AsyncIterator[TokenDelta]:
        """Both phases on a decode replica (counted by ``reason``)."""
        self.num_local_prefills += 1
        if reason == "no_prefill_replica" and self._prefill_at_zero():
            reason = "prefill_pool_at_zero"  # away by design (the autoscaler, the config), not dead
        elif reason in ("no_prefill_replica", "prefill_failed"):
            self.num_colocated_fallbacks += 1
            log.warning("no live prefill replica: request %s is prefilled on the decode pool", req.request_id)
        metrics.count_decode_pool_prefill(reason or "decode")
        return self._whole_request("decode", "generate_colocated", req, progress)

    async def _decode_handoff(self, req: GenerateRequest, pre: PrefillResponse,
                              progress: StreamProgress | None) -> AsyncIterator[TokenDelta]:
        """The prefill replica's first token, then the decode replica's stream from its hand-off."""
        decoded = False  # a decode token back (not a keep-alive): the decode side pulled the blocks
        ended = False    # the decode stream ran to its end: its pull's notification released the lease
        # A decode call in flight may be pulling the blocks: its replica releases the lease once
        # that pull ended (a release from here could free blocks a one-sided READ still reads).
        taken = False
        try:
            yield TokenDelta.of_prefill(pre)
            if pre.finish_reason is not None:
                return
            # The decode call goes where the router puts it (free KV), not where choice 0 prefilled.
            decode = dataclasses.replace(req, handoff=pre,
                                         routing=dataclasses.replace(req.routing, prefer_worker=None))
            give_up_at = min(pre.lease_deadline_unix - _HANDOFF_LEASE_MARGIN_S, time.time() + self.handoff_wait_s)
            while True:
                calls: list[Call] = []  # the Serve call, once made
                taken = True
                try:
                    async for chunk in self._relay("decode", "generate", decode, progress, calls):
                        decoded = decoded or not chunk.waiting
                        # Its last token: a consumer may stop here (a whole response closes the stream).
                        ended = ended or chunk.finish_reason is not None
                        yield chunk
                    ended = True
                    return
                except BaseException as exc:
                    taken = bool(calls) and _reached_a_replica(calls[0].stream) and not decode_call_over(exc)
                    # The first token went out: a full decode replica means wait for a seat (the lease
                    # holds the blocks), never an error mid-stream -- until the lease runs short.
                    if not isinstance(exc, BackendOverloaded) or decoded or time.time() > give_up_at:
                        raise
                self.num_handoff_waits += 1
                yield TokenDelta.waiting_on("")  # waiting for a seat: no stall (the inter-token deadline)
                await asyncio.sleep(_HANDOFF_RETRY_S)
        finally:
            held = bool(pre.block_ids) and pre.finish_reason is None and not ended
            if held and not decoded and not taken:
                # Client gone before the decode call, decode 429, pull failure, decode death: no pull
                # will happen (or it already ended): the blocks go back now, not at the lease's TTL.
                self._in_background(self._release(pre))
            elif held and calls:
                # A stream that did not run to its end.  Cancelled on its replica (or Serve could not
                # yet tell whether it got there), which releases once its pull ended -- if its
                # generate ran at all: a call cancelled before it started never does.  Or its replica
                # pulled and died: the pull's notification may not have left it (a replica killed
                # 10 tokens after its pull stranded the lease until its TTL).  Released here once the
                # call is over there (a second release of a lease is a no-op).
                self._in_background(self._release_when_over(calls[0].watcher, pre))

    def _in_background(self, coro) -> asyncio.Task:
        """Runs ``coro`` as a task this backend keeps until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _release_when_over(self, call: asyncio.Task, pre: PrefillResponse) -> None:
        """Releases ``pre``'s lease once ``call`` (its decode call's watcher) ended, no pull of it can
        still run; not after the lease's own deadline (the owner frees the blocks then)."""
        left_s = pre.lease_deadline_unix - time.time() if pre.lease_deadline_unix else _RELEASE_WAIT_S
        await asyncio.wait({call}, timeout=max(left_s, 0.0))
        if call.done():
            await self._release(pre)

    async def _release(self, pre: PrefillResponse) -> None:
        """Drops ``pre``'s lease on the prefill replica that holds it (routed by worker name)."""
        pinned = RoutingHeader((), 0, self.block_size, 0, target_worker=pre.worker_name)
        response = self.handles["prefill"].release.remote(LeaseRelease(pre.request_id, pinned))
        try:
            async with asyncio.timeout(_RELEASE_TIMEOUT_S):
                if await response:
                    self.num_lease_releases += 1
        except Exception as exc:  # noqa: BLE001 - the lease's TTL is the last resort
            response.cancel()
            log.warning("releasing the lease of %s on %s failed: %r", pre.request_id, pre.worker_name, exc)

    def _whole_request(self, pool: str, method: str, req: GenerateRequest,
                       progress: StreamProgress | None = None) -> AsyncIterator[TokenDelta]:
        """Both phases on one replica of ``pool`` (its ``method`` streams TokenDeltas)."""
        return self._relay(pool, method, req, progress)

    async def _prefill(self, req: GenerateRequest) -> PrefillResponse:
        for attempt in (0, 1):
            response = self.handles["prefill"].prefill.remote(req)
            try:
                return await response
            except asyncio.CancelledError:
                response.cancel()  # the replica aborts the prefill and frees its blocks
                raise
            except _REPLICA_DIED as exc:
                if attempt:
                    raise BackendFailure(f"prefill failed twice (replica died): {exc}") from exc
                self.prefill_retries += 1
                log.warning("prefill replica died before hand-off; retrying once: request=%s", req.request_id)
            except Exception as exc:  # noqa: BLE001 - re-raised typed
                raise backend_error(exc) from exc
        raise AssertionError("unreachable")

    async def _relay(self, pool: str, method: str, req: GenerateRequest, progress: StreamProgress | None = None,
                     calls: list | None = None) -> AsyncIterator[TokenDelta]:
        """One streaming call of ``method`` on ``pool`` (made when first iterated; appended to
        ``calls``) and its deltas: over the token channel when this gateway has an inbox
        (token_inbox.py), else through Serve.  A lost replica raises ReplicaLost (failover.py
        decides what follows); a request-level error (429, bad request, a failure of this request
        alone) its typed error."""
        key, box = None, None
        if self.inbox is not None:
            reply_to, box = self.inbox.open()
            key, req = reply_to.key, dataclasses.replace(req, reply_to=reply_to)
        box = box if box is not None else asyncio.Queue()  # no inbox: Serve's items alone
        stream = getattr(self.handles[pool].options(stream=True), method).remote(req)
        watcher = self._in_background(watch_call(stream, box))  # ends when the call ends on its replica
        if calls is not None:
            calls.append(Call(stream, watcher))
        deltas = ordered_replies(box)
        finished, replica = False, ""
        try:
            async for delta in deltas:
                delta: TokenDelta
                finished = delta.finish_reason is not None
                if delta.streamed_by:
                    replica = delta.streamed_by
                    if progress is not None:
                        progress.replica = replica
                yield delta
        except _REPLICA_DIED as exc:
            raise ReplicaLost(FailoverReason.REPLICA_DIED, f"the replica serving this stream died: {exc}",
                              replica) from exc
        except Exception as exc:  # noqa: BLE001 - re-raised typed
            err = exc if isinstance(exc, BackendError) else backend_error(exc)
            if err is exc and not isinstance(exc, BackendError):
                raise ReplicaLost(FailoverReason.STREAM_BROKEN, f"stream failed: {exc}", replica) from exc
            reason = lost_reason(err)
            if reason is not None:
                raise ReplicaLost(reason, str(err), replica, cause=err) from exc
            raise err from exc
        finally:
            if not finished:
                stream.cancel()  # client left or failure: the replica aborts and frees blocks
            if key is not None:
                self.inbox.close(key)
            await deltas.aclose()

    # ---- readiness ---------------------------------------------------------
    def _needed_pools(self) -> tuple[str, ...]:
        if self.mode == "colocated":
            return ("colocated",)
        return ("decode",)  # the decode replicas prefill when no prefill replica is alive

    async def _live(self, pool: str) -> int:
        """Replicas of ``pool`` whose engine loop is alive: from the status
        board, or (no Redis) by asking the pool itself."""
        count = await self.liveness.live(pool) if self.liveness is not None else None
        if count is not None:
            return count
        response = self.handles[pool].status.remote()
        try:
            async with asyncio.timeout(2.0):
                return int(bool((await response).get("engine_alive")))
        except Exception:  # noqa: BLE001 - no answer: not ready
            response.cancel()
            return 0

    async def health(self) -> dict:
        """Ready = a request sent now succeeds: every pool the mode needs has a
        replica with a live engine loop."""
        if self.liveness is not None:
            await self.liveness.scaled_to_zero("prefill")  # fresh targets before choosing the pools
        live = {pool: await self._live(pool) for pool in self._needed_pools()}
        missing = [pool for pool, n in live.items() if n == 0]
        if missing:
            return {"status": "unavailable", "live_replicas": live,
                    "reason": f"no live replica in the {', '.join(missing)} pool(s) yet; wait or scale up"}
        return {"status": "ok", "live_replicas": live, "admission": self.admission.view()}
