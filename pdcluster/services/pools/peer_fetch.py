"""Peer prefix fetch: before prefilling a prompt, a replica pulls the leading
blocks another live replica holds instead of recomputing them.

    puller (this replica)                                holder (its peer)
    ---------------------                                -----------------
    index.lookup(hashes) -> who holds how many           (this replica too: a first plan from that)
    local = leading blocks here (pool + tiers)           (only when the first plan pulls)
    plan_peer_fetch (pdcluster/router/peer_fetch.py): pull?
    lease_prefix(PrefixLeaseRequest) -- Serve call ----> its tier blocks back into its pool,
                                                         match (hash + tokens), acquire,
                                                         pin under a lease, checksums
               <------------------------------------ PrefixLease(block ids, checksums, deadline)
    reserve fresh blocks (engine: peer_import.py)
    transfer.pull(..., notif=lease id, deadline,  ----> (READ / socket: the hand-off's path)
                  expected checksums)                    notification -> lease released
    land: hash chain verified, committed to the prefix cache
    then the request is added: its admission finds the blocks as a local hit

Every failure (no holder answered, the lease ran out, the transfer broke,
a checksum or hash differed, no room) costs a recompute, is counted and
logged, and gives back what it took: the fresh blocks go back to the pool
(quarantined while a READ may still land), an unpulled lease is released at
the holder (its TTL is the last resort).  Nothing here fails the request.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pdcluster.prefix_store.hashing import hash_prompt_blocks
from pdcluster.router.peer_fetch import (DEFAULT_PULL_OVERHEAD_S, DEFAULT_RECOMPUTE_S_PER_TOKEN, PeerFetchPlan,
                                         plan_peer_fetch, role_of)
from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.messages import GenerateRequest, PrefixLease, PrefixLeaseRequest
from pdcluster.services.pools.fetch_overhead import FetchOverhead
from pdcluster.transfer.errors import LeaseExpiredError, TransferInDoubtError

log = logging.getLogger("pdcluster.peer_fetch")
_SETTLE_POLL_S = 0.1
# A lease with less than this left is not read: the pull could not finish inside it.
_MIN_LEASE_LEFT_S = 0.5
# A holder waits this long at most for its disk tier's blocks to load before it lends
# (a block reads in ~0.2 ms; well inside the puller's lease_timeout_s, 2 s by default).
LEND_TIER_WAIT_S = 0.5
_TIER_POLL_S = 0.002
_STILL_LOADING = object()  # stage_then_lease: the engine call that found disk blocks still loading

CallHolder = Callable[[str, PrefixLeaseRequest], Awaitable[PrefixLease | None]]


@dataclass(frozen=True)
class PeerFetchResult:
    """``pulled``: blocks now in this replica's prefix cache; ``outcome`` one of
    pulled | skipped (nothing worth pulling) | failed (recomputed, ``reason`` says why)."""
    outcome: str
    num_blocks: int = 0
    holder: str = ""
    reason: str = ""
    seconds: float = 0.0
    transfer_s: float = 0.0  # of ``seconds``: the blocks' transfer (pulled only)


SKIPPED = PeerFetchResult("skipped")


class PeerFetcher:
    def __init__(self, worker: Any, call_holder: CallHolder | None = None, min_blocks: int = 2,
                 lease_timeout_s: float = 2.0):
        self.worker = worker
        self.call_holder = call_holder or serve_call_holder
        self.min_blocks, self.lease_timeout_s = min_blocks, lease_timeout_s
        self.overhead = FetchOverhead(DEFAULT_PULL_OVERHEAD_S)  # the rule's pull_overhead_s, measured here
        self._background: set[asyncio.Task] = set()

    # ---- the estimates the rule weighs ------------------------------------------
    def _pull_s_per_block(self) -> float:
        return self.worker.pull_estimate.per_block_s()  # hand-offs' and peer pulls' transfers (pull_estimate.py)

    def _recompute_s_per_token(self) -> float:
        rate = self.worker._prefill_rate_tps
        return 1.0 / rate if rate else DEFAULT_RECOMPUTE_S_PER_TOKEN

    # ---- the puller --------------------------------------------------------------
    async def fetch(self, request: GenerateRequest) -> PeerFetchResult:
        """Pulls what a peer holds of the prompt's prefix, if worth it; never raises
        but CancelledError (then everything taken is given back)."""
        w = self.worker
        if w.transfer is None or request.draw.prompt_logprobs is not None:
            return SKIPPED  # prompt logprobs need every position computed: a cached block has none
        tokens = list(request.prompt_token_ids)
        bs = w.engine.kv_spec.block_size
        hashes = list(w.prompt_hashes(request)) or hash_prompt_blocks(w.engine.hash_seed, tokens, bs)
        usable = (len(tokens) - 1) // bs
        if usable < self.min_blocks:
            return SKIPPED
        hashes = hashes[:usable]
        lookup = await w.index.lookup(hashes)

        def plan_for(local: int) -> PeerFetchPlan | None:
            return plan_peer_fetch(lookup, w.name, local, len(tokens), bs, self._pull_s_per_block(),
                                   self._recompute_s_per_token(), pull_overhead_s=self.overhead.seconds(),
                                   min_blocks=self.min_blocks, avoid=request.routing.avoid_workers)

        # First with what the index says this replica holds (its own KV events, every tier): most
        # prompts stop here, without waiting for the engine thread's step to end (with a 1-thread
        # replica on a 2-core Sapphire Rapids that wait put ~0.1 s on chat turns' TTFT p50).
        if plan_for(min(lookup.matched_blocks.get(w.name, 0), len(hashes))) is None:
            return SKIPPED
        local = await w.aengine.run(lambda e: e.local_prefix_blocks(hashes, tokens))
        if len(hashes) - local < self.min_blocks:
            return SKIPPED
        plan = plan_for(local)
        if plan is None:
            return SKIPPED
        started = time.perf_counter()
        try:
            result = await self._pull_plan(request, plan, hashes, tokens)
        except Exception as exc:  # noqa: BLE001 - a bug here must cost a recompute, not the request
            log.exception("peer prefix fetch raised: request_id=%s holder=%s", request.request_id, plan.holder)
            result = PeerFetchResult("failed", reason=f"raised {exc!r:.200}")
        result = PeerFetchResult(result.outcome, result.num_blocks, plan.holder, result.reason,
                                 time.perf_counter() - started, result.transfer_s)
        self.overhead.observe(result.seconds - result.transfer_s)
        self._count(result)
        return result

    async def _pull_plan(self, request: GenerateRequest, plan: PeerFetchPlan, hashes: list[int],
                         tokens: list[int]) -> PeerFetchResult:
        w = self.worker
        lease_id = f"peer-{secrets.token_hex(6)}-{request.request_id}"[:200]
        ask = PrefixLeaseRequest(lease_id, tuple(tokens[:(plan.start + plan.num_blocks) * w.engine.kv_spec.block_size]),
                                 tuple(hashes[:plan.start + plan.num_blocks]), plan.start,
                                 RoutingHeader((), 0, w.engine.kv_spec.block_size, 0, target_worker=plan.holder))
        role = role_of(plan.holder)
        if role is None:
            return PeerFetchResult("failed", reason=f"holder {plan.holder!r} names no pool")
        try:
            lease = await asyncio.wait_for(self.call_holder(role, ask), self.lease_timeout_s)
        except asyncio.TimeoutError:
            # It may still lend: released now, or by its TTL if this never lands.
            self._release(None, plan.holder, lease_id)
            return PeerFetchResult("failed", reason=f"no lease from {plan.holder} within {self.lease_timeout_s} s")
        except Exception as exc:  # noqa: BLE001 - a holder gone or failing costs a recompute
            return PeerFetchResult("failed", reason=f"lease call to {plan.holder} failed: {exc!r:.200}")
        if lease is None or not lease.block_ids:
            return PeerFetchResult("failed", reason=f"{plan.holder} no longer holds the prefix")
        if lease.lease_deadline_unix - time.time() < _MIN_LEASE_LEFT_S:
            self._release(lease.peer, plan.holder, lease_id)
            return PeerFetchResult("failed", reason="the lease ran out before the pull could start")
        return await self._pull_lease(request, lease, plan.start, hashes, tokens)

    async def _pull_lease(self, request: GenerateRequest, lease: PrefixLease, start: int, hashes: list[int],
                          tokens: list[int]) -> PeerFetchResult:
        w, key, n = self.worker, lease.lease_id, len(lease.block_ids)
        # A block left for each running request's next tokens: a pull never causes a preemption.
        local_ids = await w.aengine.run_or_undo(
            lambda e: e.peer_imports.reserve(key, n, request.params.tenant, keep_free=len(e.scheduler.running)),
            lambda e, got: e.peer_imports.drop(key))
        if local_ids is None:
            self._release(lease.peer, lease.worker_name, key)
            return PeerFetchResult("failed", reason=f"no room for {n} blocks")
        pull = asyncio.ensure_future(asyncio.to_thread(
            w.transfer.pull, lease.peer, list(lease.block_ids), local_ids, key,
            lease_deadline_unix=lease.lease_deadline_unix, expected_checksums=list(lease.block_checksums)))
        try:
            stats = await asyncio.shield(pull)
        except asyncio.CancelledError:
            await asyncio.wait({pull})  # the transfer thread writes into the blocks until it returns
            exc = None if pull.cancelled() else pull.exception()
            await asyncio.shield(self._give_back(key, exc, lease))
            raise
        except Exception as exc:  # noqa: BLE001 - TransferError, OSError, or a caller bug (ValueError): recompute
            await asyncio.shield(self._give_back(key, exc, lease))
            return PeerFetchResult("failed", reason=f"pull from {lease.worker_name} failed: {exc!r:.200}")
        w.pull_estimate.observe(n, stats.seconds)  # the transfer alone: the lease call is the rule's overhead
        landed = await w.aengine.run(lambda e: e.land_peer_import(key, hashes, tokens, start))
        w.counters.peer_bytes_pulled += stats.num_bytes
        if landed.failure is not None:
            log.warning("peer prefix block refused; the rest is recomputed: request_id=%s holder=%s error=%s",
                        request.request_id, lease.worker_name, landed.failure)
        return PeerFetchResult("pulled", landed.num_committed, reason=landed.failure or "",
                               transfer_s=stats.seconds)

    async def _give_back(self, key: str, exc: BaseException | None, lease: PrefixLease) -> None:
        """After a failed or cancelled pull: the fresh blocks back (quarantined while a
        READ may still land) and, unless it ran out, the lease released at the holder."""
        aengine = self.worker.aengine
        if isinstance(exc, TransferInDoubtError):
            qkey = await aengine.run(lambda e: e.quarantine_peer_import(key))
            if qkey is not None:
                self._spawn(self._release_when_settled(exc, qkey))
        else:
            await aengine.run(lambda e: e.peer_imports.drop(key))
        if exc is not None and not isinstance(exc, (LeaseExpiredError, TransferInDoubtError)):
            self._release(lease.peer, lease.worker_name, key)

    async def _release_when_settled(self, exc: TransferInDoubtError, qkey: int) -> None:
        while not exc.settled():
            await asyncio.sleep(_SETTLE_POLL_S)
        await self.worker.aengine.release_quarantine(qkey)

    def _release(self, peer: bytes | None, holder: str, lease_id: str) -> None:
        """Tells the holder to drop the lease now (in the background, bounded)."""
        if peer is None:
            return  # never lent, or its descriptor unknown: the holder's TTL frees it
        transfer = self.worker.transfer

        async def release() -> None:
            try:
                await asyncio.to_thread(transfer.release, peer, lease_id, timeout_s=2.0)
            except Exception as exc:  # noqa: BLE001 - the TTL is the last resort
                log.info("releasing peer lease %s on %s failed: %s", lease_id, holder, exc)

        self._spawn(release())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _count(self, result: PeerFetchResult) -> None:
        c = self.worker.counters
        c.peer_fetches += 1
        if result.outcome == "pulled":
            c.peer_blocks_pulled += result.num_blocks
            c.peer_fetch_seconds += result.seconds
        else:
            c.peer_fetch_failures += 1
            log.warning("peer prefix fetch failed; the prefix is recomputed: holder=%s reason=%s",
                        result.holder, result.reason)


# ---- the holder ------------------------------------------------------------------
async def lend_prefix(worker: Any, ask: PrefixLeaseRequest) -> PrefixLease | None:
    """Pins the prompt's cached blocks ``ask.start``... under ``ask.lease_id``;
    None when this replica's pool holds none of them (or it serves no transfer)."""
    if worker.transfer is None:
        return None
    lent = await stage_then_lease(worker, ask)
    if lent is None:
        return None
    block_ids, deadline_unix = lent
    try:
        # Cached full blocks are never written again while referenced: the checksums hold until release.
        checksums = await asyncio.to_thread(worker.transfer.checksums, block_ids)
    except BaseException:
        await asyncio.shield(worker.aengine.release_lease(ask.lease_id))
        raise
    worker.counters.peer_blocks_lent += len(block_ids)
    return PrefixLease(ask.lease_id, tuple(block_ids), tuple(checksums), deadline_unix, worker.transfer.describe(),
                       worker.name)


async def stage_then_lease(worker: Any, ask: PrefixLeaseRequest) -> tuple[tuple[int, ...], float] | None:
    """The engine's lease (engine.lease_prefix) after the blocks this replica holds only in its
    host or disk tier went back into its pool (engine.stage_for_lending), so the lease lends them
    too.  Host blocks are copied in the same call as the lease; disk blocks are read by the tiers'
    loader thread, waited for up to LEND_TIER_WAIT_S (then the lease lends what has landed; the
    rest lands later, cached).  Each call waits for the engine's current step, so a lease with
    nothing on disk costs one, as it did before tiers.  A cancelled wait leaves the load to land by
    itself."""
    key, deadline, first = f"lend:{ask.lease_id}", time.monotonic() + LEND_TIER_WAIT_S, True

    def attempt(e):
        nonlocal first
        loading = e.stage_for_lending(key, ask.block_hashes, ask.prompt_token_ids) if first \
            else e.tier_blocks_loading(key)
        first = False
        if loading and time.monotonic() < deadline:
            return _STILL_LOADING
        return e.lease_prefix(ask.lease_id, ask.block_hashes, ask.prompt_token_ids, ask.start)

    while (lent := await worker.aengine.run(attempt)) is _STILL_LOADING:
        await asyncio.sleep(_TIER_POLL_S)
    return lent


_HANDLES: dict[str, Any] = {}


async def serve_call_holder(role: str, ask: PrefixLeaseRequest) -> PrefixLease | None:
    """Asks the holder's pool; ``ask.routing.target_worker`` pins the call to it."""
    from ray import serve

    handle = _HANDLES.get(role)
    if handle is None:
        app = serve.get_replica_context().app_name
        handle = _HANDLES[role] = serve.get_deployment_handle(role, app_name=app)
    return await handle.lease_prefix.remote(ask)
