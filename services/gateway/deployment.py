"""The OpenAI-compatible ingress deployment ("gateway"): tokenizes, hashes
the prompt's blocks for the router, and streams from the cluster backend.
The HTTP routes themselves live in services/openai/."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from ray import serve
from starlette.types import ASGIApp, Receive, Scope, Send

from kernels.kv_quant import pool_dtype
from observability import tracing
from services.gateway.admission import Admission
from services.gateway.cluster_backend import ClusterBackend
from services.config import ClusterConfig
from services.gateway.failover_log import FailoverLog
from services.engine.model.config import ModelConfig
from services.engine.model.default import resolve_model_path
from services.engine.model.loader import block_hash_seed, parse_dtype, weights_id
from services.engine.tokenizer import Tokenizer
from services.gateway.http import GatewayHTTPServer
from services.openai.gateway_metrics import GatewayMetrics
from services.openai.replica_board import StatusBoardReader
from services.openai.routes import configure_app, create_app
from services.openai.settings import OpenAISettings
from services.gateway.liveness import PoolLiveness
from services.replica_loopback import bind_replica_grpc_to_loopback

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
            configure_app(target, _HOST["backend"], _HOST["tokenizer"], _HOST["settings"], _HOST["metrics"])
        await self.asgi(scope, receive, send)


app.add_middleware(_AttachHost)


def _model_config(path) -> ModelConfig:
    import json

    if path.is_file():
        import gguf

        from services.engine.model.gguf_loader import read_gguf_config
        return read_gguf_config(gguf.GGUFReader(str(path)))
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


@serve.ingress(app)
class Gateway:
    async def __init__(self, config: dict, **handles):
        bind_replica_grpc_to_loopback()
        tracing.setup_tracing("pdcluster-gateway")
        cfg = ClusterConfig.model_validate(config)
        path = resolve_model_path(cfg.model)
        mc = _model_config(path)
        max_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        tokenizer = Tokenizer.from_path(path, mc)
        settings = OpenAISettings(
            served_model_names=(cfg.served_model_name,),
            block_hash_seed=block_hash_seed(weights_id(path), pool_dtype(cfg.kv_cache_dtype, parse_dtype(cfg.dtype)),
                                            cfg.block_size),
            block_size=cfg.block_size, max_body_bytes=cfg.max_body_bytes,
            api_key_digests=cfg.api_key_digests)  # validating cfg refused an exposed host without keys
        adm = cfg.admission
        backend = ClusterBackend(handles, mode=cfg.mode, model_name=cfg.served_model_name,
                                 max_model_len=max_len, block_size=cfg.block_size,
                                 liveness=PoolLiveness(cfg.index_url, cfg.cluster_name),
                                 fallback_to_colocated=cfg.fallback_to_colocated,
                                 local_prefill_max_tokens=cfg.router.local_prefill_max_tokens,
                                 admission=Admission(adm.ttft_slo_s, adm.max_in_flight, adm.shed,
                                                     adm.ttft_headroom),
                                 request_timeout_s=adm.request_timeout_s,
                                 inter_token_timeout_s=adm.inter_token_timeout_s,
                                 max_failovers=cfg.max_failovers,
                                 failovers=FailoverLog(cfg.index_url, cfg.cluster_name))
        # /metrics: the admission counters, and every replica's KV numbers from the status board.
        self.board = StatusBoardReader(cfg.index_url, cfg.cluster_name)
        gateway_metrics = GatewayMetrics(board=self.board, admission_view=backend.admission.view,
                                         failover_view=backend.failovers.view)
        _HOST.update(backend=backend, tokenizer=tokenizer, settings=settings, metrics=gateway_metrics)
        self.http: GatewayHTTPServer | None = None
        if cfg.ingress == "gateway":
            self.http = GatewayHTTPServer(app, cfg.host, cfg.port)
            self.http.start()
        log.info("gateway ready: mode=%s model=%s ingress=%s api_keys=%d", cfg.mode, cfg.served_model_name,
                 cfg.ingress, len(cfg.api_key_digests))

    async def __del__(self):
        """Serve awaits this when it stops the replica: in-flight streams finish first."""
        if self.http is not None:
            await self.http.stop()
        await self.board.aclose()


GatewayDeployment = serve.deployment(Gateway, name="gateway")
