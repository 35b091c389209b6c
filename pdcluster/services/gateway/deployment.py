"""The OpenAI-compatible ingress deployment ("gateway"): tokenizes, hashes
the prompt's blocks for the router, and streams from the cluster backend.
The HTTP routes themselves live in pdcluster/services/openai/."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from ray import serve
from starlette.types import ASGIApp, Receive, Scope, Send

from pdcluster.observability import tracing
from pdcluster.prefix_store.index import make_index
from pdcluster.prefix_store.url_reference import resolve_index_url
from pdcluster.services.config import ClusterConfig
from pdcluster.services.default_model import resolve_model_path
from pdcluster.services.tokenizer import Tokenizer
from pdcluster.services.gc_pauses import freeze_startup_heap
from pdcluster.services.gateway.admission import Admission
from pdcluster.services.gateway.placement import Rules
from pdcluster.services.gateway.cluster_backend import ClusterBackend
from pdcluster.services.gateway.failover_log import FailoverLog
from pdcluster.services.gateway.http import GatewayHTTPServer
from pdcluster.services.gateway.liveness import PoolLiveness
from pdcluster.services.gateway.seed_check import SeedCheck
from pdcluster.services.gateway.token_inbox import TokenInbox
from pdcluster.services.cluster_secret import cluster_secret
from pdcluster.services.model_meta import model_hash_seed, read_model_config
from pdcluster.services.openai.gateway_metrics import GatewayMetrics
from pdcluster.services.openai.slo import Slo
from pdcluster.services.openai.replica_board import StatusBoardReader
from pdcluster.services.openai.rate_limits import TenantLimit, TenantRateLimits
from pdcluster.services.openai.routes import configure_app, create_app
from pdcluster.services.openai.settings import OpenAISettings
from pdcluster.services.replica_logs import into_replica_log
from pdcluster.services.replica_loopback import bind_replica_grpc_to_loopback
from pdcluster.services.supervisor import RestartPolicy, Supervisor

log = logging.getLogger("pdcluster.gateway")
app: FastAPI = create_app(request_id_header=False)  # Serve's proxy sets x-request-id
# Serve runs a deserialized copy of ``app`` in the replica, so __init__ cannot
# reach its ``state``; it fills this holder and the middleware attaches it.
_HOST: dict = {}


class _AttachHost:
    """Pure ASGI (Starlette's ``@app.middleware("http")`` would pipe every SSE
    chunk through an extra task and memory stream): configures the app the
    request reached, once, from what ``Gateway.__init__`` left in ``_HOST``."""

    def __init__(self, asgi: ASGIApp):
        self.asgi = asgi

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = scope.get("app")
        if _HOST and target is not None and getattr(target.state, "backend", None) is None:
            configure_app(target, _HOST["backend"], _HOST["tokenizer"], _HOST["settings"], _HOST["metrics"],
                          _HOST["rate_limits"])
        await self.asgi(scope, receive, send)


app.add_middleware(_AttachHost)


class GatewayBackend(ClusterBackend):
    """The cluster backend, healthy only while every replica hashes blocks
    with the gateway's seed (seed_check.py)."""

    def __init__(self, handles: dict, *, seed_check: SeedCheck, **options):
        super().__init__(handles, **options)
        self.seed_check = seed_check

    async def health(self) -> dict:
        status = await super().health()
        problems = await self.seed_check.problems()
        if problems:
            return {**status, "status": "unavailable", "reason": "; ".join(problems)}
        return status


def admission_for(cfg: ClusterConfig) -> Admission:
    """Admission and placement from the config: SLOs, the shared speed model, the schedulers' step sizes."""
    adm, sched = cfg.admission, cfg.scheduler
    serving = cfg.decode if cfg.mode == "disaggregated" else cfg.colocated
    prefill, step = cfg.autoscaling.speed.models()
    rules = Rules(prefill=prefill, step=step, ttft_slo_s=adm.ttft_slo_s, tpot_slo_s=adm.tpot_slo_s,
                  headroom=adm.ttft_headroom, batch_tokens=sched.max_num_batched_tokens,
                  decode_step_tokens=sched.decode_step_prefill_tokens,
                  max_local_prefill_s=adm.max_local_prefill_s, shed=adm.shed,
                  long_prefill_tokens=sched.long_prefill_tokens)
    return Admission(adm.ttft_slo_s, adm.max_in_flight, adm.shed, adm.ttft_headroom, rules=rules,
                     decode_seats_per_replica=sched.max_num_seqs + serving.max_queue,
                     tenant_weights={t.name: t.weight for t in cfg.tenants},
                     adopts_measured_prefill=cfg.autoscaling.speed.measures_at_start(),
                     adopts_measured_step=cfg.autoscaling.speed.measures_step_at_start())


@serve.ingress(app)
class Gateway:
    async def __init__(self, config: dict, **handles):
        bind_replica_grpc_to_loopback()
        into_replica_log()
        cfg = ClusterConfig.model_validate(config)
        tracing.setup_tracing("pdcluster-gateway", jsonl_path=cfg.trace_file)
        cfg = cfg.model_copy(update={"index_url": resolve_index_url(cfg.index_url)})  # a reference in Serve's config
        path = resolve_model_path(cfg.model)
        mc = read_model_config(path)
        max_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        tokenizer = Tokenizer.from_path(path, mc)  # without transformers where the model cache allows (text_tokenizer.py)
        hash_seed = model_hash_seed(path, cfg.dtype, cfg.kv_cache_dtype, cfg.block_size, cfg.weight_dtype)
        settings = OpenAISettings(
            served_model_names=(cfg.served_model_name,), block_hash_seed=hash_seed,
            block_size=cfg.block_size, max_body_bytes=cfg.max_body_bytes,
            api_key_digests=cfg.api_key_digests,  # validating cfg refused an exposed host without keys
            tenant_of_digest={d: t.name for t in cfg.tenants for d in t.api_key_digests},
            trust_tenant_header=cfg.tenant_header, tenant_names=tuple(t.name for t in cfg.tenants),
            tenant_min_priority={t.name: t.min_priority for t in cfg.tenants if t.min_priority is not None},
            fault_injection=cfg.fault_injection or None)  # off in the config: the environment may still say on
        adm = cfg.admission
        # The board: /metrics reads every replica's KV numbers from it, the seed check their seeds.
        self.board = StatusBoardReader(cfg.index_url, cfg.cluster_name)
        self.inbox: TokenInbox | None = None  # the replicas' streamed tokens arrive here (token_inbox.py)
        if cfg.token_channel:
            self.inbox = TokenInbox(cfg.topology.internal_address(), cluster_secret())
            await self.inbox.start()
        backend = GatewayBackend(handles, seed_check=SeedCheck(hash_seed, self.board, handles),
                                 mode=cfg.mode, model_name=cfg.served_model_name,
                                 max_model_len=max_len, block_size=cfg.block_size,
                                 liveness=PoolLiveness(cfg.index_url, cfg.cluster_name),
                                 fallback_to_colocated=cfg.fallback_to_colocated,
                                 local_prefill_max_tokens=cfg.router.local_prefill_max_tokens,
                                 admission=admission_for(cfg),
                                 request_timeout_s=adm.request_timeout_s,
                                 inter_token_timeout_s=adm.inter_token_timeout_s,
                                 first_token_timeout_s=adm.first_token_timeout(),
                                 max_failovers=cfg.max_failovers,
                                 resume_local_max_tokens=cfg.resume_local_max_tokens(),
                                 failovers=FailoverLog(cfg.index_url, cfg.cluster_name),
                                 prefix_index=make_index(cfg.index_url, cluster=cfg.cluster_name,
                                                         model=cfg.served_model_name,
                                                         lookup_timeout_s=cfg.router.lookup_timeout_s)
                                 if cfg.enable_prefix_caching and cfg.index_url else None,
                                 prefill_policy=cfg.router.prefill_policy, inbox=self.inbox)
        gateway_metrics = GatewayMetrics(board=self.board, admission_view=backend.admission.view,
                                         failover_view=backend.failovers.view, model_name=cfg.served_model_name,
                                         block_size=cfg.block_size,
                                         slo=Slo(adm.ttft_slo_s, adm.tpot_slo_s),
                                         prefix_caching=cfg.enable_prefix_caching,
                                         token_channel_view=self.inbox.view if self.inbox is not None else None)
        _HOST.update(backend=backend, tokenizer=tokenizer, settings=settings, metrics=gateway_metrics,
                     rate_limits=TenantRateLimits(TenantLimit(t.name, t.requests_per_s, t.tokens_per_s, t.burst_s)
                                                  for t in cfg.tenants))
        self.http: GatewayHTTPServer | None = None
        self.supervisor = Supervisor("gateway")
        if cfg.ingress == "gateway":
            self.http = GatewayHTTPServer(app, cfg.host, cfg.port)
            # Its socket is bound once: a server that stops by itself fails health, Serve replaces the replica.
            self.supervisor.start("http_server", self.http.serve, RestartPolicy(restart=False))
        frozen = freeze_startup_heap()   # start-up's objects out of every later collection (gc_pauses.py)
        log.info("gateway ready: mode=%s model=%s ingress=%s api_keys=%d (%d start-up objects frozen)", cfg.mode,
                 cfg.served_model_name, cfg.ingress, len(cfg.api_key_digests), frozen)

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes Serve
        replace the replica (a background task, e.g. the HTTP server, is dead)."""
        self.supervisor.check_health()

    async def drain(self, timeout_s: float) -> dict:
        """Stops admitting (503 + Retry-After, /ready 503) and waits at most
        ``timeout_s`` for the requests in flight (pdcluster/services/openai/drain.py)."""
        result = await app.state.drain.wait_idle(timeout_s)
        log.info("gateway drained: %s", result)
        return result

    async def __del__(self):
        """Serve awaits this when it stops the replica: in-flight streams finish first."""
        if self.http is not None:
            self.supervisor.expect_end("http_server")
            await self.http.stop()
        await self.supervisor.stop()
        await self.board.aclose()
        if self.inbox is not None:
            await self.inbox.stop()


GatewayDeployment = serve.deployment(Gateway, name="gateway")
