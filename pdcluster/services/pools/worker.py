"""What every engine replica runs besides the engine: the async engine, the
KV-transfer backend over its pool, the KV-event publisher to the global
prefix index, admission limits and the stats the router reads.

No Serve decorators here: prefill.py, decode.py and colocated.py wrap it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import time
from dataclasses import dataclass

from pdcluster.kernels.kv_quant import kv_dtype_label
from pdcluster.prefix_store.index import make_index
from pdcluster.prefix_store.publisher import KVEventPublisher
from pdcluster.prefix_store.url_reference import resolve_index_url
from pdcluster.prefix_store.worker_id import WorkerId
from pdcluster.router.replica_stats import ReplicaStats
from pdcluster.services.pools import faults
from pdcluster.observability import metrics, tracing
from pdcluster.observability.stages import WholeStages
from pdcluster.services.backend import BackendOverloaded, engine_errors_as_backend_errors
from pdcluster.services.cluster_secret import cluster_secret
from pdcluster.services.config import ClusterConfig, PoolConfig
from pdcluster.services.engine.async_engine import AsyncEngine
from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.kv_tier_stats import tier_status
from pdcluster.services.gc_pauses import freeze_startup_heap
from pdcluster.services.replica_logs import into_replica_log
from pdcluster.services.replica_loopback import bind_replica_grpc_to_loopback
from pdcluster.services.messages import GenerateRequest, PrefixLease, PrefixLeaseRequest, TokenDelta
from pdcluster.router.peer_fetch import DEFAULT_PULL_S_PER_BLOCK
from pdcluster.services.pools.peer_fetch import PeerFetcher, lend_prefix
from pdcluster.services.pools.pull_estimate import PullEstimate
from pdcluster.services.pools.busy_flag import BusyFlag, flag_path
from pdcluster.services.pools.core_lending import Lending, ThreadChooser, borrow_forever, host_id
from pdcluster.services.pools.profile_store import profile_store_for
from pdcluster.services.pools.shutdown_steps import run_steps
from pdcluster.services.pools.startup_profile import start_up_profiles
from pdcluster.services.pools.status_board import publish_forever
from pdcluster.services.pools.token_sender import TokenSender
from pdcluster.services.supervisor import RestartPolicy, Supervisor
from pdcluster.transfer import KVLayout, create_backend

log = logging.getLogger("pdcluster.worker")
_NOTIF_WAIT_S = 1.0  # the notification waiter's longest sleep (it wakes at once on one)
# A step takes well under a second (chunked prefill bounds it); an engine
# loop silent for this long is stuck, and Serve should replace the replica.
_STUCK_LOOP_S = 60.0
SHUTDOWN_STEP_S = 5.0  # each shutdown step's bound (Serve's grace period for the whole: shutdown_timeout_s, 30 s)


@dataclass
class WorkerCounters:
    requests: int = 0
    rejected_overload: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    blocks_pulled: int = 0
    blocks_reused_locally: int = 0
    bytes_pulled: int = 0
    transfer_seconds: float = 0.0
    leases_released: int = 0
    late_notifications: int = 0
    peer_fetches: int = 0          # prefixes a peer held past this replica's own: pulls tried (peer_fetch.py)
    peer_blocks_pulled: int = 0    # ... blocks they brought into the prefix cache
    peer_fetch_failures: int = 0   # ... tries that fell back to recompute
    peer_bytes_pulled: int = 0
    peer_fetch_seconds: float = 0.0
    peer_blocks_lent: int = 0      # blocks this replica lent to a peer's pull


class Worker:
    def __init__(self, config: ClusterConfig, pool: PoolConfig, role: str, name: str | None = None,
                 with_transfer: bool = True):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        bind_replica_grpc_to_loopback()
        into_replica_log()
        self.config, self.pool, self.role = config, pool, role
        self.name = name or f"{role}-{os.getpid()}"
        tracing.setup_tracing(f"pdcluster-{role}", config.trace_file, instance=self.name)
        self.worker_id = WorkerId.new(self.name)
        # Serve's config carries a reference to the URL, never its password (index_url_ref.py).
        index_url = resolve_index_url(config.index_url) or os.environ.get("REDIS_URL") or None
        self.index_url = index_url
        self.index = make_index(index_url, cluster=config.cluster_name, model=config.served_model_name)
        self.publisher = KVEventPublisher(self.index, self.worker_id, info={"role": role})
        self.engine = Engine(config.engine_config(pool, replica=self.name), on_kv_event=self.publisher.on_event,
                             on_tier_event=self.publisher.on_tier_event)
        # Timed before the engine loop starts: admission's first prior (startup_profile.py).
        # A replica that decodes also times its decode step (admission's TPOT bound and the streams
        # beside a prompt it prefills).  Both come from the model cache once measured there (profile_store.py).
        speed = config.autoscaling.speed
        self.prefill_profile, self.step_profile = start_up_profiles(
            self.engine, prefill=speed.measures_at_start(),
            step=role != "prefill" and speed.measures_step_at_start(),
            store=profile_store_for(self.engine) if speed.reuse_saved_profile else None)
        self.aengine = AsyncEngine(self.engine)
        self.transfer = None
        self.internal_address = config.topology.internal_address()  # where its KV peer serves
        if with_transfer:
            # Every block-server connection, descriptor and lease release is
            # authenticated with the per-cluster secret `pdcluster up` generated.
            # It serves and advertises the topology's internal address (loopback on one host).
            self.transfer = create_backend(config.transfer_backend, peer_id=self.name.replace(":", "-"),
                                           timeout_s=config.transfer_timeout_s, secret=cluster_secret(),
                                           internal_host=self.internal_address,
                                           allow_fallback=config.topology.allow_transfer_fallback)
            kv = self.engine.kv.kv_pool
            # The lease table vets every owner-side read (a late pull never reads recycled blocks).
            self.transfer.register_pool(kv, KVLayout.of_pool(kv, self.engine.hash_seed),
                                        lease_guard=self.engine.leases)
        self.counters = WorkerCounters()
        self.sender = TokenSender(self.name, cluster_secret())  # streams' deltas to the gateways' inboxes
        self.pull_estimate = PullEstimate(DEFAULT_PULL_S_PER_BLOCK)  # per block, from this replica's pulls
        self.peer_fetch = None  # pulls a prefix a peer holds before prefilling it here
        if self.transfer is not None and config.peer_fetch.enabled:
            self.peer_fetch = PeerFetcher(self, min_blocks=config.peer_fetch.min_blocks,
                                          lease_timeout_s=config.peer_fetch.lease_timeout_s)
        self.in_flight = 0
        self._prefill_rate_tps = 0.0
        self.supervisor = Supervisor(self.name)  # its background tasks: logged, counted, restarted
        self.host = host_id()  # replicas on one host lend each other idle cores (core_lending.py)
        self.busy_flag: BusyFlag | None = None  # set while a request is in flight (busy_flag.py)
        self.threads = ThreadChooser(self.pool.num_threads, config.cluster_name)
        self._started = False

    async def start(self) -> None:
        """Background tasks need the replica's event loop: call from an async method."""
        if self._started:
            return
        self._started = True
        # The publisher returns by itself only when a newer epoch of this worker took over.
        self.supervisor.start("kv_event_publisher", self.publisher.run, RestartPolicy(may_return=True))
        self.supervisor.start("gauge_exporter",  # returns by itself only outside Ray
                              lambda: metrics.export_gauges_forever(self.role, self.name, lambda: self.aengine.stats),
                              RestartPolicy(may_return=True))
        if self.index_url and self.index_url.startswith("redis"):
            self.supervisor.start("status_board", lambda: publish_forever(
                self.index_url, self.config.cluster_name, self.name, self.status))
            self._open_busy_flag()
            if self.pool.borrow_idle_cores and self.busy_flag is not None:
                self.engine.threads_source = self.threads
                self.supervisor.start("core_lending", lambda: borrow_forever(
                    self.index_url, self.config.cluster_name, self.name, self.pool.num_threads,
                    self._may_borrow))
        if self.transfer is not None:
            self.supervisor.start("lease_notifications", self._release_on_notification)
        frozen = freeze_startup_heap()   # start-up's objects out of every later collection (gc_pauses.py)
        log.info("%s: %d start-up objects frozen out of garbage collection", self.name, frozen)

    async def _release_on_notification(self) -> None:
        """Releases each lease a puller is done with, as its notification arrives
        (a thread of its own waits on the transfer backend: no poll loop)."""
        loop = asyncio.get_running_loop()
        waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-notifications")
        try:
            while True:
                try:
                    arrived = await loop.run_in_executor(waiter, self.transfer.wait_notifications, _NOTIF_WAIT_S)
                    for n in arrived:
                        if await self.aengine.release_lease(n.lease_id):
                            self.counters.leases_released += 1
                        else:  # already released (gateway) or expired: the puller vetted its own deadline
                            self.counters.late_notifications += 1
                            metrics.count_lease_event("late_notification")
                except Exception:  # noqa: BLE001 - keep releasing whatever happens
                    log.exception("handling transfer notifications failed")
                    await asyncio.sleep(_NOTIF_WAIT_S)
        finally:
            waiter.shutdown(wait=False)  # its last wait ends within _NOTIF_WAIT_S

    # ---- admission -------------------------------------------------------
    @contextlib.contextmanager
    def admitted(self, capacity: int):
        """Holds one of ``capacity`` request slots of this replica; beyond
        them, BackendOverloaded (-> 429 with Retry-After).  Counted here, at
        arrival, because the engine's own queue only sees a request after its
        next step."""
        if self.in_flight >= capacity:
            self.counters.rejected_overload += 1
            raise BackendOverloaded(
                f"{self.role} replica {self.name} has {self.in_flight} requests in flight "
                f"(limit {capacity}); retry shortly", retry_after_s=1.0)
        self.counters.requests += 1
        self.in_flight += 1
        if self.busy_flag is not None:
            self.busy_flag.set(True)
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.busy_flag is not None and self.in_flight == 0:
                self.busy_flag.set(False)

    def prompt_hashes(self, request: GenerateRequest) -> tuple[int, ...]:
        """The gateway's hashes of the prompt's full blocks, for the engine to
        take as they are (it hashes only when the gateway used another block size)."""
        return request.block_hashes if request.routing.block_size == self.engine.kv_spec.block_size else ()

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        if seconds > 0 and num_tokens > 0:
            rate = num_tokens / seconds
            self._prefill_rate_tps = rate if not self._prefill_rate_tps else 0.8 * self._prefill_rate_tps + 0.2 * rate

    # ---- health --------------------------------------------------------------
    def check_health(self) -> None:
        """Raises when this replica cannot serve: its engine loop died or is
        stuck, or a background task stopped for good."""
        self.aengine.check_alive()
        self.supervisor.check_health()
        age = self.aengine.heartbeat_age_s()
        if age > _STUCK_LOOP_S:
            raise RuntimeError(f"{self.name}: the engine loop has not completed a turn for {age:.0f} s")

    def engine_alive(self) -> bool:
        return self.aengine.alive and self.aengine.heartbeat_age_s() <= _STUCK_LOOP_S

    # ---- views -------------------------------------------------------------
    def routing_stats(self) -> dict:
        s = self.aengine.stats
        fetch = self.peer_fetch  # with peer fetch on, the router prices a pull as this replica measured it
        return ReplicaStats(worker_name=self.name, prefill_tokens_per_s=self._prefill_rate_tps or None,
                            free_kv_blocks=s.kv_blocks_free, running_requests=s.num_running,
                            queued_prefill_tokens=0,
                            pull_s_per_block=self.pull_estimate.per_block_s() if fetch else None,
                            pull_overhead_s=fetch.overhead.seconds() if fetch else None).to_routing_stats()

    def status(self) -> dict:
        s = self.aengine.stats
        return {
            "name": self.name, "role": self.role, "pid": os.getpid(), "engine_alive": self.engine_alive(),
            "running": s.num_running, "waiting": s.num_waiting, "awaiting_kv": s.num_awaiting_kv,
            "kv_blocks_total": s.kv_blocks_total, "kv_blocks_free": s.kv_blocks_free,
            "kv_dtype": kv_dtype_label(self.engine.kv_spec.dtype), "hash_seed": self.engine.hash_seed,
            "kv_blocks_cached": s.kv_blocks_cached, "leased_blocks": s.leased_blocks,
            "quarantined_blocks": s.quarantined_blocks, "tenant_kv_blocks": s.tenant_kv_blocks,
            "prompt_tokens_computed": s.prompt_tokens_computed, "prompt_tokens_cached": s.prompt_tokens_cached,
            "preemptions": s.num_preemptions, "in_flight": self.in_flight,
            "spec_proposed_tokens": s.spec_proposed_tokens, "spec_accepted_tokens": s.spec_accepted_tokens,
            "spec_tokens_per_step": s.spec_tokens_per_step,
            "kv_tiers": tier_status(s.kv_tiers),
            "counters": self.counters.__dict__.copy(),
            "task_crashes": self.supervisor.crash_counts(),
            "queue_time_s": metrics.queue_times(self.role).snapshot(),
            "transfer_backend": self.transfer.name if self.transfer else None,
            "token_channel_fallbacks": self.sender.num_fallbacks,  # streams that named an inbox but went via Serve
            "internal_address": self.internal_address,
            "host": self.host, "threads": self.pool.num_threads, "compute_threads": self.engine.compute_threads,
            "thread_changes": self.threads.num_changes,
            "prefill_per_token_s": self.prefill_profile.per_token_s if self.prefill_profile else None,
            "prefill_per_token2_s": self.prefill_profile.per_token2_s if self.prefill_profile else None,
            "decode_step_s": ([self.step_profile.base_s, self.step_profile.per_seq_s] if self.step_profile
                              else None),
            "time": time.time(),
        }

    def _open_busy_flag(self) -> None:
        try:
            self.busy_flag = BusyFlag(flag_path(self.config.cluster_name, self.name))
        except OSError as exc:  # no shared memory to write: lend nothing, borrow nothing
            log.warning("%s: no busy flag (%s): this replica neither lends nor borrows cores", self.name, exc)
            return
        self.busy_flag.set(self.in_flight > 0)

    def _may_borrow(self, lend: Lending) -> None:
        """The board reader's view: what this replica may borrow, before each step."""
        if lend.extra != self.threads.lend.extra:
            log.info("%s may compute with %d threads (own %d) while %s idle", self.name,
                     self.pool.num_threads + lend.extra, self.pool.num_threads, ", ".join(lend.neighbours) or "-")
        self.threads.update(lend)

    async def drain_leases(self) -> None:
        """Waits (at most one lease TTL) until decode replicas have pulled every
        pinned block, so scaling a prefill pool down never strands a hand-off."""
        deadline = time.monotonic() + self.config.lease_ttl_s
        while (time.monotonic() < deadline and self.aengine.alive
               and await self.aengine.run(lambda e: len(e.leases))):
            await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        """Timed, bounded steps (shutdown_steps.py): a stuck one costs SHUTDOWN_STEP_S and is named
        on the replica's log, not Serve's whole grace period unnamed."""
        if self.transfer is not None and self.aengine.alive:
            # bounded by the lease TTL itself; an engine that died meanwhile has nothing left to drain
            await run_steps(self.name, [("drain_leases", self.drain_leases)], self.config.lease_ttl_s + 1.0)
        steps = [("supervisor", self.supervisor.stop), ("publisher", self.publisher.stop),
                 ("engine_loop", self.aengine.shutdown), ("board_reader", self.threads.reader.close)]
        steps.append(("token_channels", self.sender.close))
        if self.busy_flag is not None:
            steps.append(("busy_flag", self.busy_flag.close))
        steps.append(("engine", self.engine.close))  # the tiers' workers; the disk tier's directory goes with them
        if self.transfer is not None:
            steps.append(("transfer", self.transfer.close))
        await run_steps(self.name, steps, SHUTDOWN_STEP_S)


async def stream_whole_request(worker: Worker, request: GenerateRequest, capacity: int):
    """Both phases on this replica's engine (colocated mode, and the decode
    pool's fallback when no prefill replica is alive)."""
    timer = metrics.RequestTimer(worker.role, clock=time.monotonic)   # the engine's clock: first_scheduled_s
    stages = WholeStages(request.trace_context, worker.name, worker.engine.kv_spec.block_size, request.span_tags())
    queued = prefilled = False
    error: BaseException | None = None
    try:
        with worker.admitted(capacity), engine_errors_as_backend_errors():
            if worker.peer_fetch is not None:
                await worker.peer_fetch.fetch(request)
            async for out in worker.aengine.generate(request.request_id, request.prompt_token_ids, request.params,
                                                     prior_output_token_ids=request.prior_output_token_ids,
                                                     block_hashes=worker.prompt_hashes(request), draw=request.draw):
                stages.on_output(out)
                if timer.num_tokens == 0:
                    metrics.count_prompt_tokens(worker.role, worker.name, out.num_prompt_tokens,
                                                out.num_cached_tokens)
                scheduled_s = getattr(out, "first_scheduled_s", None)
                if not queued and scheduled_s is not None:
                    queued = True
                    metrics.observe_queue(worker.role, max(scheduled_s - timer.start_s, 0.0))
                if not prefilled and out.new_token_ids and scheduled_s is not None:  # its prefill: peer fetch weighs it
                    prefilled = True
                    worker.note_prefill(out.num_prompt_tokens + len(request.prior_output_token_ids)
                                        - out.num_cached_tokens, time.monotonic() - scheduled_s)
                faults.drop_stream(request.faults, timer.num_tokens, resumed=bool(request.prior_output_token_ids))
                timer.on_tokens(len(out.new_token_ids))
                yield TokenDelta.of_output(out, streamed_by=worker.name, worker_name=worker.name)
    except BaseException as exc:
        error = exc
        raise
    finally:
        stages.finish(error)  # prefill.queue, prefill.compute, decode.generate spans
    timer.finish()


class WorkerEndpoints:
    """What every engine deployment answers besides its own work: status for
    operators, routing stats for the request router, and a clean shutdown
    (Serve awaits ``__del__`` when it stops a replica)."""
    worker: Worker

    async def status(self) -> dict:
        return self.worker.status()

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes Serve replace the replica."""
        self.worker.check_health()

    def record_routing_stats(self) -> dict:
        return self.worker.routing_stats()

    async def lease_prefix(self, ask: PrefixLeaseRequest) -> PrefixLease | None:
        """A peer's pull of a prefix this replica caches (pdcluster/services/pools/peer_fetch.py);
        ``ask.routing.target_worker`` pins the call here."""
        return await lend_prefix(self.worker, ask)

    async def __del__(self):
        await self.worker.shutdown()
