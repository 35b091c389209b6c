"""The gateway's Backend over Serve handles: prefill -> KV pull -> decode
(disaggregated), or one colocated pool.

    gateway ──prefill.remote(req, routing)──> prefill replica (router: cache-aware)
       │  <── first token + pinned blocks + peer descriptor
       ├──stream first token to the client
       └──decode.generate(req + hand-off, routing)──> decode replica (router: free KV)
             pulls missing blocks (NIXL READ), releases the lease, streams tokens

A prefill replica that dies before the hand-off is retried once (the router
picks again); a decode replica that dies mid-stream ends the stream with an
error; replica-side typed errors keep their HTTP meaning."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import exceptions as ray_exceptions
from ray.serve.exceptions import BackPressureError

from router.routing_header import RoutingHeader
from services import metrics
from services.backend import (Backend, BackendError, BackendFailure, BackendOverloaded, BackendUnavailable,
                              GenerateRequest, StreamChunk)
from services.messages import DecodeRequest, PrefillRequest, PrefillResponse, TokenDelta
from services.pool_liveness import PoolLiveness

log = logging.getLogger("pdcluster.gateway")
_REPLICA_DIED = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)


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


class ClusterBackend(Backend):
    def __init__(self, handles: dict[str, Any], *, mode: str, model_name: str, max_model_len: int,
                 block_size: int, liveness: PoolLiveness | None = None, fallback_to_colocated: bool = False,
                 local_prefill_max_tokens: int = 0):
        self.handles = handles
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

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
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
        yield StreamChunk([pre.first_token_id], pre.text, pre.finish_reason,
                          num_prompt_tokens=pre.num_tokens, num_cached_tokens=pre.num_cached_tokens)
        if pre.finish_reason is not None:
            return
        stream = self.handles["decode"].options(stream=True).generate.remote(
            DecodeRequest(req.request_id, req.prompt_token_ids, req.params, pre, req.trace_context),
            routing=self._header(req))
        async for chunk in self._relay(stream):
            yield chunk

    def _whole_request(self, pool: str, method: str, req: GenerateRequest) -> AsyncIterator[StreamChunk]:
        """Both phases on one replica of ``pool`` (its ``method`` streams TokenDeltas)."""
        stream = getattr(self.handles[pool].options(stream=True), method).remote(
            PrefillRequest(req.request_id, req.prompt_token_ids, req.params, req.trace_context),
            routing=self._header(req))
        return self._relay(stream)

    async def _prefill(self, req: GenerateRequest) -> PrefillResponse:
        message = PrefillRequest(req.request_id, req.prompt_token_ids, req.params, req.trace_context)
        for attempt in (0, 1):
            try:
                return await self.handles["prefill"].prefill.remote(message, routing=self._header(req))
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
