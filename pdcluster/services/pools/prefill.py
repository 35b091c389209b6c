"""PrefillServer: computes a prompt's KV (chunked, reusing its local prefix
cache), samples the first token, and keeps the prompt's blocks pinned under
a lease until the decode replica has pulled them (or the lease expires).
A resumed stream's request brings the tokens already sent: their KV is
computed after the prompt's, and the token sampled is the next one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from ray import serve

from pdcluster.services.pools import faults
from pdcluster.services.backend import engine_errors_as_backend_errors
from pdcluster.services.config import ClusterConfig
from pdcluster.services.messages import GenerateRequest, LeaseRelease, PrefillResponse, TokenDelta
from pdcluster.observability.stages import PrefillStages
from pdcluster.services.pools.worker import Worker, WorkerEndpoints, stream_whole_request

_SHORT_LEASE_S = 0.5  # the short_lease fault's TTL


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

    async def prefill(self, request: GenerateRequest) -> PrefillResponse:
        w = self.worker
        started = time.perf_counter()
        stages = PrefillStages(request.trace_context, w.name, self.cfg.block_size, request.span_tags())
        if faults.has(request.faults, "kill_prefill_engine"):
            w.aengine.inject_fault("kill")
        try:
            # A prefill replica's queue is everything not yet prefilled.
            with w.admitted(self.cfg.prefill.max_queue), engine_errors_as_backend_errors():
                if w.peer_fetch is not None:
                    await w.peer_fetch.fetch(request)
                last = None
                # A resumed stream's long remainder (pdcluster/services/gateway/failover.py): prompt + prior output.
                async for out in w.aengine.generate(request.request_id, request.prompt_token_ids, request.params,
                                                    prefill_only=True, block_hashes=w.prompt_hashes(request),
                                                    prior_output_token_ids=request.prior_output_token_ids,
                                                    draw=request.draw):
                    last = out
                if last.prefill is not None and faults.has(request.faults, "short_lease"):
                    last.prefill = await w.aengine.run(
                        lambda e: e.shorten_lease(request.request_id, _SHORT_LEASE_S, last.prefill))
        except BaseException as exc:
            stages.failed(exc)
            raise
        block_ids = last.prefill.block_ids if last.prefill else ()
        # What the decode side checks the pulled blocks against (pdcluster/transfer/checksum.py): off the engine
        # thread; the leased blocks are not written again.
        checksums = await asyncio.to_thread(w.transfer.checksums, block_ids) if block_ids else ()
        if block_ids and faults.has(request.faults, "reuse_leased_block"):
            await w.aengine.run(lambda e: _overwrite_partial_last_block(e, last.prefill))
        stages.done(last)  # prefill.queue + prefill.compute spans, prefill metrics
        seconds = time.perf_counter() - started
        computed = last.num_prompt_tokens + len(request.prior_output_token_ids) - last.num_cached_tokens
        w.note_prefill(computed, seconds)
        w.counters.prompt_tokens += last.num_prompt_tokens
        w.counters.prompt_tokens_cached += last.num_cached_tokens
        done = last.finish_reason.value if last.prefill is None else None
        return PrefillResponse(
            request_id=request.request_id, first_token_id=last.new_token_ids[0], text=last.text_delta,
            finish_reason=done, block_ids=block_ids, block_checksums=checksums,
            num_tokens=last.num_prompt_tokens, num_cached_tokens=last.num_cached_tokens,
            peer=w.transfer.describe(), worker_name=w.name, prefill_s=seconds,
            lease_deadline_unix=last.prefill.lease_deadline_unix if last.prefill else 0.0,
            logprobs=last.logprobs, prompt_logprobs=last.prompt_logprobs)

    async def generate_colocated(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Both phases here: where the gateway resumes a stream whose decode
        replica died when no other decode replica is live and
        ``fallback_to_colocated`` is set (pdcluster/services/gateway/failover.py)."""
        async for delta in stream_whole_request(self.worker, request, self.cfg.prefill.max_queue):
            yield delta

    async def release(self, release: LeaseRelease) -> bool:
        """Drops a lease (the gateway's path when no pull will happen); its
        ``routing.target_worker`` pins the call to the replica holding it."""
        return await self.worker.aengine.release_lease(release.request_id)


def _overwrite_partial_last_block(engine, prefill) -> None:
    """Fault reuse_leased_block: the hand-off's last block changes after its
    checksum was taken, as a block released early and reused would.  Only a
    partial last block (never in the prefix cache, so no other request reads it)."""
    if prefill.num_tokens % engine.kv_spec.block_size:
        engine.kv.kv_pool[prefill.block_ids[-1]].zero_()


PrefillDeployment = serve.deployment(PrefillServer, name="prefill")
