"""ColocatedServer: one engine doing both phases (small deployments, and the
A/B baseline for disaggregation).  Same engine, same stream format."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from ray import serve

from pdcluster.services.config import ClusterConfig
from pdcluster.services.messages import ChannelDone, GenerateRequest, TokenDelta
from pdcluster.services.pools.prefill import _replica_name
from pdcluster.services.pools.token_sender import over_channel
from pdcluster.services.pools.worker import Worker, WorkerEndpoints, stream_whole_request


class ColocatedServer(WorkerEndpoints):
    async def __init__(self, config: dict):
        self.cfg = ClusterConfig.model_validate(config)
        self.worker = Worker(self.cfg, self.cfg.colocated, "colocated", _replica_name("colocated"),
                             with_transfer=self.cfg.peer_fetch.enabled)  # pulls and lends prefixes
        await self.worker.start()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta | ChannelDone]:
        capacity = self.cfg.scheduler.max_num_seqs + self.cfg.colocated.max_queue
        deltas = stream_whole_request(self.worker, request, capacity)
        async with aclosing(over_channel(self.worker.sender, request, deltas)) as items:
            async for item in items:
                yield item


ColocatedDeployment = serve.deployment(ColocatedServer, name="colocated")
