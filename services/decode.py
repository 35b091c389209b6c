"""DecodeServer: reserves blocks for a prefilled prompt (reusing any leading
blocks its own prefix cache holds), pulls the rest from the prefill replica
in one transfer, tells it to drop the lease, then streams the decode."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray import serve

from services.backend import BackendFailure, BackendInvalidRequest, BackendOverloaded
from services.config import ClusterConfig
from services.engine.errors import InvalidRequestError
from services.messages import DecodeRequest, PrefillRequest, TokenDelta
from services.prefill import _replica_name
from services.stage_telemetry import DecodeStages
from services.worker import Worker, WorkerEndpoints, stream_whole_request
from transfer import TransferError

_RESERVE_RETRY_S = 0.02


class DecodeServer(WorkerEndpoints):
    async def __init__(self, config: dict):
        self.cfg = ClusterConfig.model_validate(config)
        self.worker = Worker(self.cfg, self.cfg.decode, "decode", _replica_name("decode"))
        await self.worker.start()

    async def _reserve(self, req: DecodeRequest):
        """Blocks for the prompt; waits briefly when the pool is full."""
        aengine = self.worker.aengine
        deadline = asyncio.get_running_loop().time() + self.cfg.transfer_timeout_s
        while True:
            try:
                alloc = await aengine.reserve_external(req.request_id, req.prompt_token_ids, req.params)
            except InvalidRequestError as exc:
                raise BackendInvalidRequest(str(exc)) from exc
            if alloc is not None:
                return alloc
            if asyncio.get_running_loop().time() > deadline:
                raise BackendOverloaded(f"decode replica {self.worker.name} has no free KV blocks; retry shortly")
            await asyncio.sleep(_RESERVE_RETRY_S)

    async def _pull(self, req: DecodeRequest, alloc, stages: DecodeStages) -> int:
        w, pre = self.worker, req.prefill
        remote = list(pre.block_ids[alloc.num_cached_blocks:])
        local = list(alloc.missing_block_ids)
        try:
            stats = await asyncio.to_thread(w.transfer.pull, pre.peer, remote, local, req.request_id)
        except (TransferError, OSError) as exc:
            await w.aengine.abort(req.request_id)
            raise BackendFailure(f"KV transfer from {pre.worker_name} failed: {exc}") from exc
        stages.pulled(alloc, stats, len(remote))  # kv.transfer span: bytes, seconds, GB/s
        w.counters.blocks_pulled += len(remote)
        w.counters.blocks_reused_locally += alloc.num_cached_blocks
        w.counters.bytes_pulled += stats.num_bytes
        w.counters.transfer_seconds += stats.seconds
        return len(remote)

    async def generate(self, req: DecodeRequest, routing: dict | None = None) -> AsyncIterator[TokenDelta]:
        w = self.worker
        stages = DecodeStages(req.trace_context, w.name, self.cfg.block_size, w.transfer.name)
        error: BaseException | None = None
        try:
            # Decodes run for long: the batch's seats plus the queue.
            with w.admitted(self.cfg.scheduler.max_num_seqs + self.cfg.decode.max_queue):
                alloc = await self._reserve(req)
                stages.reserved()
                pulled = await self._pull(req, alloc, stages)
                first = True
                async for out in w.aengine.decode_external(req.request_id, req.prefill.first_token_id):
                    stages.on_output(out)
                    yield TokenDelta(out.new_token_ids, out.text_delta,
                                     out.finish_reason.value if out.finished else None,
                                     num_prompt_tokens=out.num_prompt_tokens,
                                     num_cached_tokens=req.prefill.num_cached_tokens,
                                     blocks_pulled=pulled if first else 0,
                                     blocks_reused=alloc.num_cached_blocks if first else 0)
                    first = False
        except BaseException as exc:
            error = exc
            raise
        finally:
            stages.finish(error)  # decode.queue + decode.generate spans, decode metrics


    async def generate_colocated(self, request: PrefillRequest, routing: dict | None = None
                                 ) -> AsyncIterator[TokenDelta]:
        """Both phases here: the gateway's counted fallback when no prefill
        replica is alive and ``fallback_to_colocated`` is set."""
        capacity = self.cfg.scheduler.max_num_seqs + self.cfg.decode.max_queue
        async for delta in stream_whole_request(self.worker, request, capacity):
            yield delta


DecodeDeployment = serve.deployment(DecodeServer, name="decode")
