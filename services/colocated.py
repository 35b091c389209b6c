"""ColocatedServer: one engine doing both phases (small deployments, and the
A/B baseline for disaggregation).  Same engine, same stream format."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from services.backend import BackendInvalidRequest
from services import metrics
from services.config import ClusterConfig
from services.engine.errors import InvalidRequestError
from services.messages import PrefillRequest, TokenDelta
from services.prefill import _replica_name
from services.worker import Worker, WorkerEndpoints


class ColocatedServer(WorkerEndpoints):
    async def __init__(self, config: dict):
        self.cfg = ClusterConfig.model_validate(config)
        self.worker = Worker(self.cfg, self.cfg.colocated, "colocated", _replica_name("colocated"),
                             with_transfer=False)
        await self.worker.start()

    async def generate(self, request: PrefillRequest, routing: dict | None = None) -> AsyncIterator[TokenDelta]:
        w = self.worker
        timer = metrics.RequestTimer("colocated")
        with w.admitted(self.cfg.scheduler.max_num_seqs + self.cfg.colocated.max_queue):
            try:
                async for out in w.aengine.generate(request.request_id, request.prompt_token_ids, request.params):
                    if timer.num_tokens == 0:
                        metrics.count_prompt_tokens("colocated", w.name, out.num_prompt_tokens, out.num_cached_tokens)
                    timer.on_tokens(len(out.new_token_ids))
                    yield TokenDelta(out.new_token_ids, out.text_delta,
                                     out.finish_reason.value if out.finished else None,
                                     num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens)
            except InvalidRequestError as exc:
                raise BackendInvalidRequest(str(exc)) from exc
            timer.finish()


ColocatedDeployment = serve.deployment(ColocatedServer, name="colocated")
