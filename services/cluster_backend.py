"""The gateway's Backend over Serve handles: prefill -> KV pull -> decode
(disaggregated), or one colocated pool.

    gateway ──admission (429 when the predicted TTFT breaks the SLO)
       ├──prefill.remote(req, routing)──> prefill replica (router: cache-aware)
       │  <── first token + pinned blocks + lease deadline + peer descriptor
       ├──stream first token to the client
       ├──decode.generate(req + hand-off, routing)──> decode replica (router: free KV)
       │     pulls missing blocks (NIXL READ), releases the lease, streams tokens
       └──finally, if no decode token came back: prefill.release(lease) on the
          replica that holds it (it is idempotent; the decode side releases too)

Every request runs under two deadlines (end-to-end, and the gap between
tokens once the first arrived); past either, the calls in flight are
cancelled (the replicas abort and free their blocks) and the client gets
504 or an SSE error event.  A prefill replica that dies before the
hand-off is retried once (the router picks again); a decode replica that
dies mid-stream ends the stream with an error; replica-side typed errors
keep their HTTP meaning."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import exceptions as ray_exceptions
from ray.serve.exceptions import BackPressureError

from router.routing_header import RoutingHeader
from services import metrics
from services.admission import Admission
from services.backend import (Backend, BackendError, BackendFailure, BackendOverloaded, BackendTimeout,
                              BackendUnavailable, GenerateRequest, StreamChunk)
from services.messages import DecodeRequest, PrefillRequest, PrefillResponse, TokenDelta
from services.pool_liveness import PoolLiveness

log = logging.getLogger("pdcluster.gateway")
_REPLICA_DIED = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)
_RELEASE_TIMEOUT_S = 5.0


def backend_error(exc: BaseException) -> BaseException:
    """The typed error a replica raised, unwrapped from Ray's task error."""
    if isinstance(exc, BackPressureError):
        return BackendOverloaded(f"the pool's queue is full: {exc}; retry shortly")
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray_exceptions.RayTaskError) and isinstance(cause, BackendError):
        return cause
    return exc


def prefill_locally(prompt_tokens: int, local_prefill_max_tokens: int) -> bool:
    """Conditional disaggregation: whether the decode replica prefills this prompt itself."""
    return 0 < prompt_tokens <= local_prefill_max_tokens


async def with_deadlines(chunks: AsyncIterator[StreamChunk], request_timeout_s: float,
                         inter_token_timeout_s: float) -> AsyncIterator[StreamChunk]:
    """``chunks``, or BackendTimeout once the end-to-end deadline passes or,
    after the first chunk, no chunk came for ``inter_token_timeout_s``.  The
    timeout cancels ``chunks`` where it waits, which cancels the replica
    calls it has in flight (their ``finally`` blocks abort and release)."""
    loop = asyncio.get_running_loop()
    end_s = loop.time() + request_timeout_s
    first = True
    try:
        while True:
            gap_ends_s = end_s if first else min(end_s, loop.time() + inter_token_timeout_s)
            try:
                async with asyncio.timeout_at(gap_ends_s):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                metrics.count_deadline("request" if gap_ends_s >= end_s else "inter_token")
                if gap_ends_s >= end_s:
                    raise BackendTimeout(f"the request ran past its {request_timeout_s:g} s deadline "
                                         "(admission.request_timeout_s) and was aborted") from None
                raise BackendTimeout(f"no token for {inter_token_timeout_s:g} s (admission.inter_token_timeout_s); "
                                     "the request was aborted: retry it") from None
            first = False
            yield chunk
    finally:
        await chunks.aclose()


class ClusterBackend(Backend):
    def __init__(self, handles: dict[str, Any], *, mode: str, model_name: str, max_model_len: int,
                 block_size: int, liveness: PoolLiveness | None = None, fallback_to_colocated: bool = False,
                 local_prefill_max_tokens: int = 0, admission: Admission | None = None,
                 request_timeout_s: float = 300.0, inter_token_timeout_s: float = 30.0):
        self.handles = handles
        self.admission = admission or Admission(ttft_slo_s=float("inf"), max_in_flight=1 << 30, shed=False)
        self.request_timeout_s, self.inter_token_timeout_s = request_timeout_s, inter_token_timeout_s
        self.num_lease_releases = 0
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

    def _header(self, req: GenerateRequest) -> dict:
        return RoutingHeader(req.block_hashes, len(req.prompt_token_ids), self.block_size,
                             req.params.max_tokens).to_dict()

    def _prefill_pool(self, req: GenerateRequest) -> str:
        if self.mode == "colocated":
            return "colocated"
        return "decode" if prefill_locally(len(req.prompt_token_ids), self.local_prefill_max_tokens) else "prefill"

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        ticket = self.admission.admit(self._prefill_pool(req), len(req.prompt_token_ids))  # or 429
        chunks = with_deadlines(self._generate(req), self.request_timeout_s, self.inter_token_timeout_s)
        try:
            async for chunk in chunks:
                ticket.first_token()
                yield chunk
        finally:
            ticket.close()
            await chunks.aclose()

    async def _generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        if self.mode == "colocated":
            async for chunk in self._whole_request("colocated", "generate", req):
                yield chunk
            return
        if prefill_locally(len(req.prompt_token_ids), self.local_prefill_max_tokens):
            # Short prompts cost the decode replica less than a hand-off would:
            # it runs both phases (counted; long prompts still go to the prefill pool).
            self.num_local_prefills += 1
            metrics.count_decode_pool_prefill("short_prompt")
            async for chunk in self._whole_request("decode", "generate_colocated", req):
                yield chunk
            return
        if self.liveness is not None and await self.liveness.live("prefill") == 0:
            if not self.fallback_to_colocated:
                raise BackendUnavailable("the prefill pool has no live replica; retry later, scale it up "
                                         "(`pdcluster scale prefill N`) or set fallback_to_colocated")
            # Counted, never silent: the decode replica runs both phases.
            self.num_colocated_fallbacks += 1
            metrics.count_decode_pool_prefill("no_prefill_replica")
            log.warning("no live prefill replica: request %s runs colocated on the decode pool", req.request_id)
            async for chunk in self._whole_request("decode", "generate_colocated", req):
                yield chunk
            return
        pre = await self._prefill(req)
        decoded = False  # a decode token back means the decode side pulled and released the lease
        try:
            yield StreamChunk([pre.first_token_id], pre.text, pre.finish_reason,
                              num_prompt_tokens=pre.num_tokens, num_cached_tokens=pre.num_cached_tokens)
            if pre.finish_reason is not None:
                return
            stream = self.handles["decode"].options(stream=True).generate.remote(
                DecodeRequest(req.request_id, req.prompt_token_ids, req.params, pre, req.trace_context,
                              req.faults), routing=self._header(req))
            async for chunk in self._relay(stream):
                decoded = True
                yield chunk
        finally:
            if pre.block_ids and pre.finish_reason is None and not decoded:
                # Client gone, decode 429, pull failure, decode death, deadline: no pull will happen
                # (or it already failed): the blocks go back now, not at the lease's TTL.
                self._in_background(self._release(pre))

    def _in_background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, pre: PrefillResponse) -> None:
        """Drops ``pre``'s lease on the prefill replica that holds it (routed by worker name)."""
        header = RoutingHeader((), 0, self.block_size, 0, target_worker=pre.worker_name).to_dict()
        response = self.handles["prefill"].release.remote(pre.request_id, routing=header)
        try:
            async with asyncio.timeout(_RELEASE_TIMEOUT_S):
                if await response:
                    self.num_lease_releases += 1
        except Exception as exc:  # noqa: BLE001 - the lease's TTL is the last resort
            response.cancel()
            log.warning("releasing the lease of %s on %s failed: %r", pre.request_id, pre.worker_name, exc)

    def _whole_request(self, pool: str, method: str, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """Both phases on one replica of ``pool`` (its ``method`` streams TokenDeltas)."""
        stream = getattr(self.handles[pool].options(stream=True), method).remote(
            PrefillRequest(req.request_id, req.prompt_token_ids, req.params, req.trace_context, req.faults),
            routing=self._header(req))
        return self._relay(stream)

    async def _prefill(self, req: GenerateRequest) -> PrefillResponse:
        message = PrefillRequest(req.request_id, req.prompt_token_ids, req.params, req.trace_context, req.faults)
        for attempt in (0, 1):
            response = self.handles["prefill"].prefill.remote(message, routing=self._header(req))
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

    async def _relay(self, stream) -> AsyncIterator[StreamChunk]:
        finished = False
        try:
            async for delta in stream:
                delta: TokenDelta
                finished = delta.finish_reason is not None
                yield StreamChunk(delta.token_ids, delta.text, delta.finish_reason,
                                  num_prompt_tokens=delta.num_prompt_tokens,
                                  num_cached_tokens=delta.num_cached_tokens)
        except _REPLICA_DIED as exc:
            raise BackendFailure(f"the replica serving this stream died: {exc}") from exc
        except BackendError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised typed
            err = backend_error(exc)
            if err is exc:
                raise BackendFailure(f"stream failed: {exc}") from exc
            raise err from exc
        finally:
            if not finished:
                stream.cancel()  # client left or failure: the replica aborts and frees blocks

    # ---- readiness ---------------------------------------------------------
    def _needed_pools(self) -> tuple[str, ...]:
        if self.mode == "colocated":
            return ("colocated",)
        return ("decode",) if self.fallback_to_colocated else ("prefill", "decode")

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
        live = {pool: await self._live(pool) for pool in self._needed_pools()}
        missing = [pool for pool, n in live.items() if n == 0]
        if missing:
            return {"status": "unavailable", "live_replicas": live,
                    "reason": f"no live replica in the {', '.join(missing)} pool(s) yet; wait or scale up"}
        return {"status": "ok", "live_replicas": live, "admission": self.admission.view()}
