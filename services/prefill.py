"""PrefillServer: computes a prompt's KV (chunked, reusing its local prefix
cache), samples the first token, and keeps the prompt's blocks pinned under
a lease until the decode replica has pulled them (or the lease expires)."""

from __future__ import annotations

import time

from ray import serve

from services.backend import BackendInvalidRequest
from services.config import ClusterConfig
from services.engine.errors import InvalidRequestError
from services.messages import PrefillRequest, PrefillResponse
from services.stage_telemetry import PrefillStages
from services.worker import Worker, WorkerEndpoints


def _replica_name(role: str) -> str:
    try:
        return f"{role}-{serve.get_replica_context().replica_id.unique_id}"
    except Exception:  # noqa: BLE001 - outside Serve (tests)
        return role


class PrefillServer(WorkerEndpoints):
    async def __init__(self, config: dict):
        self.cfg = ClusterConfig.model_validate(config)
        self.worker = Worker(self.cfg, self.cfg.prefill, "prefill", _replica_name("prefill"))
        await self.worker.start()

    async def prefill(self, request: PrefillRequest, routing: dict | None = None) -> PrefillResponse:
        w = self.worker
        started = time.perf_counter()
        stages = PrefillStages(request.trace_context, w.name, self.cfg.block_size)
        try:
            # A prefill replica's queue is everything not yet prefilled.
            with w.admitted(self.cfg.prefill.max_queue):
                try:
                    last = None
                    async for out in w.aengine.generate(request.request_id, request.prompt_token_ids,
                                                        request.params, prefill_only=True):
                        last = out
                except InvalidRequestError as exc:
                    raise BackendInvalidRequest(str(exc)) from exc
        except BaseException as exc:
            stages.failed(exc)
            raise
        stages.done(last)  # prefill.queue + prefill.compute spans, prefill metrics
        seconds = time.perf_counter() - started
        computed = last.num_prompt_tokens - last.num_cached_tokens
        w.note_prefill(computed, seconds)
        w.counters.prompt_tokens += last.num_prompt_tokens
        w.counters.prompt_tokens_cached += last.num_cached_tokens
        done = last.finish_reason.value if last.prefill is None else None
        return PrefillResponse(
            request_id=request.request_id, first_token_id=last.new_token_ids[0], text=last.text_delta,
            finish_reason=done, block_ids=last.prefill.block_ids if last.prefill else (),
            num_tokens=last.num_prompt_tokens, num_cached_tokens=last.num_cached_tokens,
            peer=w.transfer.describe(), worker_name=w.name, prefill_s=seconds)

    async def release(self, request_id: str) -> bool:
        """Drops a lease (the gateway's path when no pull will happen)."""
        return await self.worker.aengine.release_lease(request_id)


PrefillDeployment = serve.deployment(PrefillServer, name="prefill")
