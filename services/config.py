"""The cluster's one user-facing config (YAML -> pydantic), every default in
one place.  ``engine_config()`` maps it onto the engine's frozen dataclass."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.engine.config import EngineConfig, SchedulerConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="Serve needs >= 1; scale to zero via autoscaling")
    num_cpus: float = Field(1.0, gt=0, description="logical Ray CPUs per replica")
    num_threads: int = Field(1, ge=1, description="torch intra-op threads per replica")
    kv_cache_mib: int = Field(512, ge=1)
    max_queue: int = Field(64, ge=1, description="requests waiting per replica before 429")
    max_ongoing_requests: int = Field(128, ge=1)
    autoscaling: dict | None = Field(None, description="Ray Serve autoscaling_config; overrides num_replicas")


class SchedulerSettings(_Strict):
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=1)
    prefill_chunk_size: int = Field(512, ge=1)
    kv_watermark_high: float = Field(0.97, gt=0, le=1)
    kv_watermark_low: float = Field(0.90, gt=0, le=1)


class RouterSettings(_Strict):
    prefill_policy: Literal["cache_aware", "least_loaded", "round_robin"] = "cache_aware"
    decode_policy: str = "decode_by_kv"
    lookup_timeout_s: float = Field(0.05, gt=0)
    local_prefill_max_tokens: int = Field(
        0, ge=0, description="disaggregated mode: prompts of at most this many tokens are prefilled on the decode "
                             "replica itself (no KV transfer, no prefill-pool queue); longer ones go to the prefill "
                             "pool.  0: every prompt goes to the prefill pool")


class AdmissionSettings(_Strict):
    """What the gateway admits, and how long a request may take."""
    ttft_slo_s: float = Field(2.0, gt=0, description="refuse (429 + Retry-After) a request whose predicted TTFT, "
                                                     "from the pool's queued prompt tokens and its measured "
                                                     "prefill rate, exceeds this")
    shed: bool = Field(True, description="false: admit everything (no SLO-based 429s)")
    max_in_flight: int = Field(1024, ge=1, description="requests the gateway serves at once before 429")
    request_timeout_s: float = Field(300.0, gt=0, description="end-to-end deadline of one request")
    inter_token_timeout_s: float = Field(30.0, gt=0, description="longest wait for the next token once "
                                                                 "the first has arrived")


class TracingSettings(_Strict):
    enabled: bool = True
    jsonl_dir: str = "runs/traces"
    record_text: bool = False


class ClusterConfig(_Strict):
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    model: str | None = Field(None, description="None: the bundled SmolLM2-135M-Instruct GGUF")
    served_model_name: str = "SmolLM2-135M-Instruct"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    block_size: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    colocated: PoolConfig = PoolConfig(num_replicas=2)
    scheduler: SchedulerSettings = SchedulerSettings()
    router: RouterSettings = RouterSettings()
    admission: AdmissionSettings = AdmissionSettings()
    index_url: str | None = Field(None, description="redis://host:port; None: REDIS_URL or an embedded Redis")
    cluster_name: str = "local"
    transfer_backend: Literal["auto", "nixl", "fallback"] = "auto"
    transfer_timeout_s: float = Field(10.0, gt=0)
    lease_ttl_s: float = Field(30.0, gt=0)
    fallback_to_colocated: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    ingress: Literal["gateway", "serve_proxy"] = Field(
        "gateway", description="gateway: the gateway replica serves HTTP on host:port itself, no Serve proxy "
                               "(one Serve hop less per streamed token); serve_proxy: Serve's HTTP proxy in front")
    max_body_bytes: int = Field(1 * 2**20, ge=1024)
    tracing: TracingSettings = TracingSettings()

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        EngineConfig(block_size=self.block_size)  # raises ValueError naming the fix
        if self.scheduler.kv_watermark_low > self.scheduler.kv_watermark_high:
            raise ValueError("scheduler.kv_watermark_low must be <= kv_watermark_high")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ClusterConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of config keys at the top level")
        return cls.model_validate(data)

    def engine_config(self, pool: PoolConfig) -> EngineConfig:
        s = self.scheduler
        return EngineConfig(
            model=self.model, dtype=self.dtype, block_size=self.block_size,
            kv_cache_bytes=pool.kv_cache_mib * 2**20, max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, lease_ttl_s=self.lease_ttl_s,
            num_threads=pool.num_threads,
            scheduler=SchedulerConfig(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                                      prefill_chunk_size=s.prefill_chunk_size, kv_watermark_high=s.kv_watermark_high,
                                      kv_watermark_low=s.kv_watermark_low))
