"""DecodeServer: reserves blocks for a prefilled prompt (reusing any leading
blocks its own prefix cache holds), pulls the rest from the prefill replica
in one transfer, tells it to drop the lease, then streams the decode.

Every path out gives back what it took: the reservation is aborted on any
exit before the decode finished (after the transfer thread stopped writing
into it), and a hand-off that was not pulled is released at the prefill
replica at once.  An expired hand-off is refused, never read.  A pulled
block whose checksum differs from the hand-off's is never committed (the
pull fails; the gateway recomputes), and the blocks of a pull whose READ
could not be confirmed stopped stay in quarantine until it settles."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from ray import serve

from pdcluster.services.pools import faults
from pdcluster.services.backend import (BackendInvalidRequest, BackendKVTransferFailed, BackendLeaseExpired, BackendOverloaded,
                              engine_errors_as_backend_errors)
from pdcluster.services.config import ClusterConfig
from pdcluster.services.messages import ChannelDone, GenerateRequest, TokenDelta
from pdcluster.services.pools.prefill import _replica_name
from pdcluster.observability.stages import DecodeStages
from pdcluster.services.pools.token_sender import over_channel
from pdcluster.services.pools.worker import Worker, WorkerEndpoints, stream_whole_request
from pdcluster.transfer import TransferError
from pdcluster.transfer.errors import LeaseExpiredError, TransferInDoubtError

log = logging.getLogger("pdcluster.decode")
_SETTLE_POLL_S = 0.1  # how often a quarantine asks whether its transfer settled
# A hand-off with less lease than this left is refused before reserving:
# the pull could not finish inside it.
_MIN_LEASE_LEFT_S = 0.5
_WAITING_EVERY_S = 0.5  # a keep-alive this often while a hand-off waits for KV (a quarter of the deadline at most)


class DecodeServer(WorkerEndpoints):
    async def __init__(self, config: dict):
        self.cfg = ClusterConfig.model_validate(config)
        self.waiting_every_s = min(_WAITING_EVERY_S, self.cfg.admission.inter_token_timeout_s / 4)
        self.worker = Worker(self.cfg, self.cfg.decode, "decode", _replica_name("decode"))
        await self.worker.start()
        self._background: set[asyncio.Task] = set()
        self._rejected_once: set[str] = set()  # fault reject_decode: request ids refused once

    def _check_lease(self, req: GenerateRequest) -> None:
        """Refuses a hand-off whose lease has (nearly) run out: its blocks may be recycled."""
        left_s = req.handoff.lease_deadline_unix - time.time()
        if req.handoff.lease_deadline_unix and left_s < _MIN_LEASE_LEFT_S:
            raise BackendLeaseExpired(
                f"the KV hand-off from {req.handoff.worker_name} expired {max(-left_s, 0):.1f} s ago, before this "
                "decode replica could pull it; retry the request (or raise lease_ttl_s)")

    async def _reserve(self, req: GenerateRequest):
        """Blocks for the prompt (and a resumed stream's tokens already sent,
        whose KV the prefill replica computed too); when the pool is full the
        reservation waits in line on the engine thread (reservation_line.py), up
        to ``transfer_timeout_s`` and never past the hand-off's usable lease
        (``generate`` streams keep-alives meanwhile)."""
        if faults.has(req.faults, "wait_for_kv"):
            await asyncio.sleep(faults.seconds(req.faults, "wait_for_kv"))
        wait_s = self.cfg.transfer_timeout_s
        if req.handoff.lease_deadline_unix:
            wait_s = min(wait_s, req.handoff.lease_deadline_unix - _MIN_LEASE_LEFT_S - time.time())
        with engine_errors_as_backend_errors():
            alloc = await self.worker.aengine.reserve_external(
                req.request_id, req.prompt_token_ids, req.params, block_hashes=self.worker.prompt_hashes(req),
                prior_output_token_ids=req.prior_output_token_ids, wait_s=max(wait_s, 0.001), draw=req.draw)
        if alloc is None:
            raise BackendOverloaded(f"decode replica {self.worker.name} has no free KV blocks; retry shortly")
        return alloc

    async def _pull(self, req: GenerateRequest, alloc, stages: DecodeStages) -> int:
        w, pre = self.worker, req.handoff
        try:
            await _inject_pull_faults(req.faults)
        except TransferError as exc:  # fail_pull: as a broken connection mid-pull would
            raise BackendKVTransferFailed(f"KV transfer from {pre.worker_name} failed: {exc}") from exc
        self._check_lease(req)
        remote = list(pre.block_ids[alloc.num_cached_blocks:])
        local = list(alloc.missing_block_ids)
        # Checked once the bytes landed: a block that changed since the hand-off is never committed.
        expected = pre.block_checksums[alloc.num_cached_blocks:] if pre.block_checksums else None
        pull = asyncio.ensure_future(asyncio.to_thread(
            w.transfer.pull, pre.peer, remote, local, req.request_id,
            lease_deadline_unix=pre.lease_deadline_unix or None, expected_checksums=expected))
        try:
            stats = await asyncio.shield(pull)
        except asyncio.CancelledError:
            # The transfer thread is still writing into the reserved blocks: they
            # may go back to the pool only once it has stopped.
            await asyncio.wait({pull})
            if not pull.cancelled() and isinstance(pull.exception(), TransferInDoubtError):
                await asyncio.shield(self._quarantine(req, pull.exception()))
            raise
        except TransferInDoubtError as exc:
            await asyncio.shield(self._quarantine(req, exc))
            raise BackendKVTransferFailed(f"KV transfer from {pre.worker_name} failed: {exc}") from exc
        except LeaseExpiredError as exc:
            raise BackendLeaseExpired(f"KV transfer from {pre.worker_name} refused: {exc}") from exc
        except (TransferError, OSError) as exc:
            raise BackendKVTransferFailed(f"KV transfer from {pre.worker_name} failed: {exc}") from exc
        stages.pulled(alloc, stats, len(remote))  # kv.transfer span: bytes, seconds, GB/s
        w.counters.blocks_pulled += len(remote)
        w.counters.blocks_reused_locally += alloc.num_cached_blocks
        w.counters.bytes_pulled += stats.num_bytes
        w.counters.transfer_seconds += stats.seconds
        w.pull_estimate.observe(len(remote), stats.seconds)
        return len(remote)

    async def _quarantine(self, req: GenerateRequest, exc: TransferInDoubtError) -> None:
        """The pull's READ may still land: its blocks stay out of reuse (the reservation
        ends, the rest of its blocks go back) until the transfer settles."""
        aengine = self.worker.aengine
        key = await aengine.quarantine(req.request_id, exc.local_block_ids)
        if key is None:
            log.error("request %s: no reservation left to hold its %d in-doubt blocks", req.request_id,
                      len(exc.local_block_ids))
            return

        async def release_when_settled() -> None:
            while not exc.settled():
                await asyncio.sleep(_SETTLE_POLL_S)
            freed = await aengine.release_quarantine(key)
            log.info("request %s: the transfer settled; %d quarantined blocks back in the pool", req.request_id,
                     freed)

        task = asyncio.get_running_loop().create_task(release_when_settled())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta | ChannelDone]:
        """The hand-off's decode, its deltas over the token channel when the call names one."""
        async with aclosing(over_channel(self.worker.sender, req, self._generate(req))) as items:
            async for item in items:
                yield item

    async def _generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if req.handoff is None:
            raise BackendInvalidRequest(f"decode of {req.request_id} without a prefill hand-off: a whole request "
                                        "goes to generate_colocated")
        w = self.worker
        stages = DecodeStages(req.trace_context, w.name, self.cfg.block_size, w.transfer.name,
                              req.span_tags())
        error: BaseException | None = None
        pulled = None  # blocks pulled; set once the pull's notification released the lease
        try:
            if faults.has(req.faults, "reject_decode") and req.request_id not in self._rejected_once:
                self._rejected_once.add(req.request_id)  # the gateway offers it again: taken then
                raise BackendOverloaded(f"decode replica {w.name} is full (injected fault); retry shortly")
            self._check_lease(req)
            # Decodes run for long: the batch's seats plus the queue.
            with w.admitted(self.cfg.scheduler.max_num_seqs + self.cfg.decode.max_queue):
                reserving = asyncio.ensure_future(self._reserve(req))
                try:
                    while not (await asyncio.wait({reserving}, timeout=self.waiting_every_s))[0]:
                        yield TokenDelta.waiting_on(w.name)  # in line for KV: alive, not stalled
                except BaseException:
                    # The gateway gave up while this waited: leave the line.  The reservation may have
                    # been made while the keep-alive was out (the generator closed at that yield with
                    # the task done): then it goes back too, or it would hold its blocks in awaiting_kv.
                    if not reserving.done():
                        reserving.cancel()
                    made = (await asyncio.gather(reserving, return_exceptions=True))[0]
                    if not isinstance(made, BaseException):
                        await asyncio.shield(w.aengine.abort(req.request_id))
                    raise
                alloc = reserving.result()
                try:
                    stages.reserved()
                    pulled = await self._pull(req, alloc, stages)
                    async for delta in self._decode(req, stages):
                        yield delta
                except BaseException:
                    # Every exit before the decode finished: the reservation goes back (a no-op once
                    # decode_external's own abort ran).
                    await asyncio.shield(w.aengine.abort(req.request_id))
                    raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            stages.finish(error)  # decode.queue + decode.generate spans, decode metrics
            # No pull happened: the prefill side frees now, not at TTL -- unless this replica was only
            # full: then the gateway offers the hand-off again (or releases it when it gives up).
            if pulled is None and req.handoff.block_ids and not isinstance(error, BackendOverloaded):
                self._release_remote(req)

    async def _decode(self, req: GenerateRequest, stages: DecodeStages) -> AsyncIterator[TokenDelta]:
        first = True
        with engine_errors_as_backend_errors():
            async for out in self.worker.aengine.decode_external(req.request_id, req.handoff.first_token_id):
                stages.on_output(out)
                faults.drop_stream(req.faults, 0 if first else 1, resumed=bool(req.prior_output_token_ids))
                if first and faults.has(req.faults, "stall_decode"):
                    self.worker.aengine.inject_fault("stall", faults.seconds(req.faults, "stall_decode"))
                if first and faults.has(req.faults, "kill_decode_engine"):
                    self.worker.aengine.inject_fault("kill")
                yield TokenDelta.of_output(out, streamed_by=self.worker.name,
                                           num_cached_tokens=req.handoff.num_cached_tokens)
                first = False

    def _release_remote(self, req: GenerateRequest) -> None:
        """Tells the prefill replica to drop the lease, in the background (bounded)."""
        transfer, pre = self.worker.transfer, req.handoff

        async def release() -> None:
            try:
                await asyncio.to_thread(transfer.release, pre.peer, req.request_id, timeout_s=2.0)
            except Exception as exc:  # noqa: BLE001 - the gateway releases too; the TTL is the last resort
                log.info("releasing lease %s on %s failed: %s", req.request_id, pre.worker_name, exc)

        task = asyncio.get_running_loop().create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def generate_colocated(self, request: GenerateRequest) -> AsyncIterator[TokenDelta | ChannelDone]:
        """Both phases here: a prompt admission places on the decode pool, or a stream resumed here."""
        capacity = self.cfg.scheduler.max_num_seqs + self.cfg.decode.max_queue
        deltas = stream_whole_request(self.worker, request, capacity)
        async with aclosing(over_channel(self.worker.sender, request, deltas)) as items:
            async for item in items:
                yield item


async def _inject_pull_faults(faults_: tuple[str, ...]) -> None:
    if faults.has(faults_, "die_before_pull"):
        os._exit(1)  # as a crash would: no cleanup, no goodbye
    if faults.has(faults_, "delay_pull"):
        await asyncio.sleep(faults.seconds(faults_, "delay_pull"))
    if faults.has(faults_, "fail_pull"):
        raise TransferError("injected pull failure (fault fail_pull)")


DecodeDeployment = serve.deployment(DecodeServer, name="decode")
