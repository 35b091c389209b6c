"""The cluster's one user-facing config (YAML -> pydantic), every default in
one place.  ``engine_config()`` maps it onto the engine's frozen dataclass."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from pdcluster.planning.speed import PrefillModel, StepModel
from pdcluster.services.engine.config import EngineConfig, KVTierConfig, SchedulerConfig, SpeculativeConfig
from pdcluster.services.sampling_params import DEFAULT_TENANT  # noqa: F401 - re-exported
from pdcluster.services.topology import TopologySettings, internal_exposure_problem, is_loopback  # noqa: F401 - re-exported


API_KEY_ENV = "PDCLUSTER_API_KEY"   # one key, or several separated by commas
_API_KEY = re.compile(r"[\x21-\x2b\x2d-\x7e]+")  # printable ASCII but space and comma: fits `Bearer <key>` and the env
_API_KEY_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def api_key_digest(key: str | bytes) -> str:
    """``sha256:<hex>``: what the gateway compares a presented key against,
    so the keys themselves never travel (deployment args) or rest (the state
    file) in clear."""
    return "sha256:" + hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def is_api_key_digest(value: object) -> bool:
    return isinstance(value, str) and _API_KEY_DIGEST.fullmatch(value) is not None


def exposure_problem(host: str, has_keys: bool, insecure: bool) -> str | None:
    """Why serving the OpenAI API on ``host`` would be unsafe, or None: a
    non-loopback address needs an API key unless the operator insists."""
    if has_keys or insecure or is_loopback(host):
        return None
    return (f"refusing to serve the gateway on {host} without an API key: anyone who can reach it could use "
            f"the cluster.  Set {API_KEY_ENV} (or api_keys / api_key_file in the config) so clients must send "
            "`Authorization: Bearer <key>`, or pass --insecure-no-auth (config: insecure_no_auth: true) to "
            "serve it open anyway")


def _checked_key(value: object, source: str) -> SecretStr:
    """Never echoes the value: it may be a real key."""
    key = value.get_secret_value() if isinstance(value, SecretStr) else value
    if not isinstance(key, str) or _API_KEY.fullmatch(key) is None:
        raise ValueError(f"{source} is not a usable API key: use printable ASCII without spaces or commas, "
                         "e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    return SecretStr(key)


def _file_keys(path: str) -> list[SecretStr]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"api_key_file {path}: cannot read it ({exc.strerror}); "
                         "it holds one key per line (blank lines and # comments are skipped)") from None
    return [_checked_key(line.strip(), f"api_key_file {path} line {n}") for n, line in enumerate(lines, 1)
            if line.strip() and not line.strip().startswith("#")]


def _env_keys() -> list[SecretStr]:
    parts = [p.strip() for p in os.environ.get(API_KEY_ENV, "").split(",")]
    return [_checked_key(p, f"{API_KEY_ENV} entry {n}") for n, p in enumerate(parts, 1) if p]




def _unique(items: list) -> tuple:
    return tuple(dict.fromkeys(items))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantSettings(_Strict):
    """A tenant: the clients holding one of its API keys (or, with
    ``tenant_header: true``, naming it in ``x-pdcluster-tenant``), and its
    rate limits (pdcluster/services/openai/rate_limits.py; none: not limited).  Its
    keys are API keys of the cluster too."""
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    api_keys: tuple[SecretStr, ...] = Field((), exclude=True, repr=False)
    api_key_digests: tuple[str, ...] = Field((), repr=False)
    requests_per_s: float | None = Field(None, gt=0, description="requests per second, on average")
    tokens_per_s: float | None = Field(None, gt=0, description="prompt + max_tokens x n, per second, on average")
    burst_s: float = Field(1.0, gt=0, le=3600, description="the buckets hold this many seconds of the rates")
    min_priority: int | None = Field(None, description="the most urgent `priority` its requests may ask (lower "
                                                       "is more urgent); a more urgent one is raised to it")
    weight: float = Field(1.0, ge=0.001, le=1000, description="its share against other tenants of one priority, in "
                                                          "prompt tokens and decode seats (the default tenant: 1)")
    kv_guaranteed: float = Field(0.0, ge=0, le=1, description="the share of each replica's KV blocks its cached "
                                                              "prefixes keep whatever other tenants send")
    kv_max: float = Field(1.0, gt=0, le=1, description="past this share of a replica's KV blocks, its own cached "
                                                       "blocks are evicted first")

    @model_validator(mode="before")
    @classmethod
    def _digest_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        name = data.get("name", "?")
        keys = [_checked_key(k, f"tenant {name!r} api_keys[{n}]") for n, k in enumerate(data.get("api_keys") or ())]
        digests = list(data.get("api_key_digests") or ())
        for n, digest in enumerate(digests):
            if not is_api_key_digest(digest):
                raise ValueError(f"tenant {name!r} api_key_digests[{n}] is not `sha256:<64 lowercase hex digits>`")
        return {**data, "api_keys": tuple(keys),
                "api_key_digests": _unique(digests + [api_key_digest(k.get_secret_value()) for k in keys])}


class PoolConfig(_Strict):
    num_replicas: int = Field(1, ge=0, description="0 only for the prefill pool: the decode replicas then prefill "
                                                   "every prompt themselves")
    num_cpus: float = Field(1.0, gt=0, description="logical Ray CPUs per replica")
    num_threads: int = Field(1, ge=1, description="torch intra-op threads per replica")
    borrow_idle_cores: bool = Field(True, description="while no other replica on the host has a request in "
                                                      "flight, compute with their threads too (given back before "
                                                      "the next engine step once one gets a request)")
    kv_cache_mib: int = Field(512, ge=1)
    max_queue: int = Field(64, ge=1, description="requests waiting per replica before 429")
    max_ongoing_requests: int = Field(128, ge=1)
    autoscaling: dict | None = Field(None, description="Ray Serve autoscaling_config; overrides num_replicas")


class SpeculativeSettings(_Strict):
    """Speculative decoding on decode and colocated replicas (pdcluster/services/engine/spec_decode.py)."""
    method: Literal["none", "ngram", "draft"] = Field(
        "none", description="ngram: drafts by prompt lookup, no draft model; draft: by draft_model")
    num_tokens: int = Field(4, ge=1, le=16, description="tokens drafted per step")
    ngram_min: int = Field(2, ge=1)
    ngram_max: int = Field(4, ge=1)
    min_acceptance: float = Field(0.3, ge=0, le=1, description="a request accepting less backs off")
    draft_model: str | None = Field(None, description="method draft: a model path sharing the target's tokenizer, "
                                                      "or 'default' (the bundled model)")
    draft_num_layers: int | None = Field(None, ge=1, description="method draft: the draft's first N decoder "
                                                                 "layers only (an early-exit draft)")

    def engine(self) -> SpeculativeConfig:
        return SpeculativeConfig(method=self.method, num_tokens=self.num_tokens, ngram_min=self.ngram_min,
                                 ngram_max=self.ngram_max, min_acceptance=self.min_acceptance,
                                 draft_model=self.draft_model, draft_num_layers=self.draft_num_layers)


class KVTierSettings(_Strict):
    """Host-memory and disk tiers under each replica's KV pool (pdcluster/services/engine/kv_tiers.py)."""
    enabled: bool = Field(False, description="evicted prefix blocks go to host memory, then disk, and load back "
                                             "on a prefix match instead of being recomputed")
    host_mib: int | None = Field(None, ge=1, description="host tier per replica; None: min(8 x its KV pool, "
                                                         "1/4 of the memory available at start)")
    disk: bool = Field(True, description="a disk tier under the host tier")
    disk_mib: int | None = Field(None, ge=1, description="disk tier per replica; None: 1/5 of the free space")
    dir: str = Field("runs/kv-tiers", description="each replica's disk tier is a directory of its own under this")

    def engine(self, replica: str) -> KVTierConfig:
        safe = re.sub(r"[^A-Za-z0-9._-]", "-", replica)
        return KVTierConfig(enabled=self.enabled, host_bytes=self.host_mib and self.host_mib * 2**20,
                            disk_dir=str(Path(self.dir) / safe) if self.disk else None,
                            disk_bytes=self.disk_mib * 2**20 if self.disk and self.disk_mib else None)


class PeerFetchSettings(_Strict):
    """Peer prefix fetch (pdcluster/services/pools/peer_fetch.py, pdcluster/router/peer_fetch.py): a replica about to
    prefill a prompt whose leading blocks another live replica holds pulls them over the transfer layer."""
    enabled: bool = Field(False, description="pull a cached prefix from the peer holding it when the pull is "
                                             "predicted cheaper than recomputing it (prefill and decode pools)")
    min_blocks: int = Field(2, ge=1, description="shorter prefixes are recomputed: asking costs a round trip")
    lease_timeout_s: float = Field(2.0, gt=0, le=60, description="how long to wait for the holder to lend the "
                                                                 "blocks; past it the prefix is recomputed")


class SchedulerSettings(_Strict):
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=1)
    prefill_chunk_size: int = Field(
        512, ge=1, description="prompt tokens of one request per step on a colocated replica; a prefill replica "
                               "(disaggregated) takes its oldest prompt's tokens up to the whole step "
                               "(max_num_batched_tokens), so prompts finish in arrival order")
    borrowed_prefill_tokens: int = Field(
        128, ge=1, description="prompt tokens a step takes while its replica computes on an idle neighbour's "
                               "cores (borrow_idle_cores): the cores go back between steps, so a short step "
                               "returns them sooner (128 tokens: about 0.3 s on 2 AVX2 threads, at the same "
                               "tokens/s as 1024-token steps); more where the replica computes more in 0.3 s by "
                               "its measured cost a token (AMX: about 1,000; engine/step_limits.py)")
    decode_step_prefill_tokens: int = Field(
        256, ge=1, description="prompt tokens a replica that decodes (a decode replica: its own prompts, resumed "
                               "streams; a colocated replica: every prompt) prefills per step beside its decodes: "
                               "bounds the pause its streams see (256 tokens: about 0.3 s on one 2-core-machine "
                               "thread).  With one request on the replica, a prompt, or beside streams that can "
                               "still end within admission.tpot_slo_s x ttft_headroom, a step takes up to "
                               "max_num_batched_tokens, as many as it computes in 0.3 s by its measured cost a "
                               "token (engine/step_limits.py)")
    long_prefill_tokens: int = Field(
        512, ge=0, description="replicas that decode (colocated, and decode replicas prefilling their own prompts) "
                               "prefill prompts with at most this many tokens left to compute ahead of longer "
                               "ones, which take what each step leaves, one at a time: a short chat is not queued "
                               "behind a long prompt.  Admission predicts the same order.  A prefill replica "
                               "keeps arrival order.  0: arrival order everywhere")
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
    resume_local_max_tokens: int | None = Field(
        None, ge=0, description="mid-stream failover: a resumed stream with at most this many tokens to prefill "
                                "again (prompt + tokens already sent) recomputes them on the new decode replica; "
                                "a longer one is prefilled by the prefill pool and handed off, as a long prompt "
                                "is.  None: local_prefill_max_tokens when set, else one prefill chunk "
                                "(scheduler.prefill_chunk_size)")


class AdmissionSettings(_Strict):
    """What the gateway admits, where it is prefilled (pdcluster/services/gateway/placement.py), and how long a
    request may take."""
    ttft_slo_s: float = Field(2.0, gt=0, description="refuse (429 + Retry-After) a request whose predicted TTFT "
                                                     "(the calibrated speed model over the work queued at the "
                                                     "place that would prefill it soonest) exceeds this")
    tpot_slo_s: float = Field(0.1, gt=0, description="a decode replica prefills a prompt itself only while its "
                                                     "streams' predicted TPOT stays within this")
    ttft_headroom: float = Field(0.8, gt=0, le=1, description="refuse (and keep TPOT) at this fraction of each "
                                                               "SLO: the margin that absorbs the prediction's noise")
    max_local_prefill_s: float = Field(1.0, ge=0, description="the longest prefill (predicted) a decode replica "
                                                              "takes on itself while a prefill replica lives: its "
                                                              "streams pause for it and later prompts wait behind "
                                                              "it; 0: never while a prefill replica lives")
    shed: bool = Field(True, description="false: admit everything (no SLO-based 429s)")
    max_in_flight: int = Field(1024, ge=1, description="requests the gateway serves at once before 429")
    request_timeout_s: float = Field(300.0, gt=0, description="end-to-end deadline of one request")
    inter_token_timeout_s: float = Field(30.0, gt=0, description="longest wait for the next token once "
                                                                 "the first has arrived (a hand-off waiting in "
                                                                 "line for a decode seat or KV is no stall: "
                                                                 "its KV lease bounds that wait)")
    first_token_timeout_s: float | None = Field(
        None, gt=0, description="longest wait for the first token, or 3x the request's predicted time to first "
                                "token when that is longer (a long prompt on a slow machine is never cut for "
                                "being long); None: 10 x ttft_slo_s, or request_timeout_s with shed false "
                                "(serving late was asked for)")

    def first_token_timeout(self) -> float:
        if self.first_token_timeout_s:
            return self.first_token_timeout_s
        return 10 * self.ttft_slo_s if self.shed else self.request_timeout_s


class AutoscalePoolBounds(_Strict):
    min_replicas: int = Field(1, ge=0, description="0 only for prefill: at low load the decode replicas prefill "
                                                  "locally and the prefill pool goes away")
    max_replicas: int = Field(2, ge=1)


class AutoscaleSpeed(_Strict):
    """One replica's speed, the model admission, placement, the autoscaler and
    the planner share (pdcluster/planning/speed.py): the `measured` lines
    `pdcluster plan --profile URL` prints.  The defaults are a 1-thread
    replica of the bundled model (bf16) measured on a 2-core AMD EPYC
    (avx512_bf16) CI machine, Dec 2: engine prefill 0.041 s at 32 tokens,
    0.64 s at 512, 2.16 s at 1500, 5.16 s at 3000; decode step 26 ms at
    batch 1, 57 ms at 16, 86 ms at 32.  The gateway calibrates them online
    from the TTFTs it measures; profile your own for the autoscaler."""
    prefill_overhead_s: float = Field(0.02, ge=0, description="per-request prefill overhead (HTTP, routing, hand-off)")
    prefill_per_token_s: float = Field(0.0012, gt=0, description="prefill seconds per prompt token")
    prefill_per_token2_s: float = Field(1.7e-7, ge=0, description="prefill seconds per squared prompt token "
                                                                   "(causal attention)")
    step_base_s: float = Field(0.015, gt=0, description="decode step time at batch 0 (the line's intercept)")
    step_per_seq_s: float = Field(0.0022, ge=0, description="decode step time added per sequence in the batch")
    measure_at_start: bool = Field(
        True, description="each replica times its own prefill at start-up, and a replica that decodes its decode "
                          "step at batch 1 and 16 (about 1 s in all: pdcluster/services/pools/startup_profile.py); "
                          "admission starts from those lines instead of prefill_per_token_s and step_*, unless "
                          "they are set here")

    reuse_saved_profile: bool = Field(
        True, description="a replica reads its start-up profile from the model cache once three replicas measured "
                          "it on this machine with the same weights and settings (the fastest of them: "
                          "pdcluster/services/pools/profile_store.py) instead of measuring; false: every replica "
                          "measures")

    def prefill_set(self) -> bool:
        """Whether the config names its own prefill line (then no start-up measurement replaces it)."""
        return "prefill_per_token_s" in self.model_fields_set

    def step_set(self) -> bool:
        """Whether the config names its own decode step line (then no start-up measurement replaces it)."""
        return bool({"step_base_s", "step_per_seq_s"} & self.model_fields_set)

    def measures_at_start(self) -> bool:
        return self.measure_at_start and not self.prefill_set()

    def measures_step_at_start(self) -> bool:
        return self.measure_at_start and not self.step_set()

    def models(self) -> tuple[PrefillModel, StepModel]:
        return (PrefillModel(overhead_s=self.prefill_overhead_s, per_token_s=self.prefill_per_token_s,
                             per_token2_s=self.prefill_per_token2_s, source="config"),
                StepModel(base_s=self.step_base_s, per_seq_s=self.step_per_seq_s, source="config"))


class AutoscalingSettings(_Strict):
    """pdcluster's own autoscaler (pdcluster/services/autoscale/controller.py; the rule in
    pdcluster/services/autoscale/policy.py): sizes the prefill and decode pools apart,
    from the gateway's live measurements and the planner's speed model.
    Off by default: on the 2-core CI machine (bench/load/autoscale.py, Dec 2,
    a 0.33 / 1.0 / 0.33 req/s ramp) it held 0.57x the replica-seconds of a
    static deployment sized for the peak, at goodput 0.86 against the static
    one's 0.77 -- and 0.75 against 1.00 in the run before: it grows 13-40 s
    into a peak, and a starting replica takes the cores the serving ones
    need.  Disaggregated mode only; it replaces the pools' num_replicas
    while it runs."""
    enabled: bool = False
    interval_s: float = Field(2.0, ge=0.5, description="seconds between measurements (and decisions); each one "
                                                    "scrapes the gateway's /metrics, so not faster than 0.5 s")
    window_s: float = Field(9.0, gt=0, description="measurements are differences over this many seconds")
    ttft_slo_s: float = Field(2.0, gt=0)
    tpot_slo_s: float = Field(0.1, gt=0)
    headroom: float = Field(0.7, gt=0, le=1, description="size for this fraction of each SLO")
    max_utilization: float = Field(0.8, gt=0, le=1, description="busy fraction a replica is planned at")
    down_margin: float = Field(1.3, ge=1, description="a scale-down must still fit demand x this (hysteresis)")
    up_cooldown_s: float = Field(15.0, ge=0, description="after any change, before the next scale-up")
    down_cooldown_s: float = Field(30.0, ge=0, description="after any change, before a scale-down")
    down_stable_s: float = Field(20.0, ge=0, description="the need must stay below the replicas this long")
    min_latency_samples: int = Field(8, ge=1, description="requests behind a p90 before it may force a scale-up")
    calibration_samples: int = Field(4, ge=1, description="requests behind the mean TPOT that calibrates the "
                                                          "decode step model (kept until a window has as many)")
    local_prefill_max_share: float = Field(
        0.2, ge=0, lt=1, description="with prefill.min_replicas 0: the prefill pool scales to zero while the prompts "
                                     "would take at most this fraction of each decode replica's time")
    prefill: AutoscalePoolBounds = AutoscalePoolBounds(min_replicas=0, max_replicas=2)
    decode: AutoscalePoolBounds = AutoscalePoolBounds(min_replicas=1, max_replicas=3)
    speed: AutoscaleSpeed = AutoscaleSpeed()

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSettings":
        if self.decode.min_replicas < 1:
            raise ValueError("autoscaling.decode.min_replicas must be >= 1: the decode pool serves every stream "
                             "(only the prefill pool may scale to zero)")
        for pool in ("prefill", "decode"):
            b = getattr(self, pool)
            if b.min_replicas > b.max_replicas:
                raise ValueError(f"autoscaling.{pool}: min_replicas {b.min_replicas} > max_replicas "
                                 f"{b.max_replicas}: raise max_replicas or lower min_replicas")
        return self


# The keys that say how the pools are laid out: a config file naming none of them gets the layout
# measured best for the machine (pdcluster/services/cli/default_layout.py), as a bare `pdcluster up` does.
LAYOUT_KEYS = frozenset({"mode", "prefill", "decode", "colocated"})


class ClusterConfig(_Strict):
    # A validation error must never print its input: it may hold an API key.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    model: str | None = Field(None, description="None: the bundled SmolLM2-135M-Instruct GGUF")
    served_model_name: str = "SmolLM2-135M-Instruct"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    kv_cache_dtype: Literal["auto", "bf16", "int8", "fp8_e4m3"] = Field(
        "auto", description="KV pool dtype; auto: the model's dtype. 8-bit halves KV memory and transfer bytes")
    weight_dtype: Literal["auto", "int8"] = Field(
        "auto", description="decoder projections' weights: auto (the model dtype) or int8 (int8 codes in "
        "groups of 32 with fp16 scale and offset, a GGUF's Q4_1/Q8_0 blocks exactly, bf16 activations: about "
        "half the bytes each decode step reads; needs dtype bfloat16)")
    block_size: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    colocated: PoolConfig = PoolConfig(num_replicas=2)
    scheduler: SchedulerSettings = SchedulerSettings()
    speculative: SpeculativeSettings = SpeculativeSettings()
    kv_tiers: KVTierSettings = KVTierSettings()
    peer_fetch: PeerFetchSettings = PeerFetchSettings()
    router: RouterSettings = RouterSettings()
    admission: AdmissionSettings = AdmissionSettings()
    index_url: str | None = Field(None, description="redis://host:port; None: REDIS_URL or an embedded Redis")
    cluster_name: str = "local"
    transfer_backend: Literal["auto", "nixl", "fallback"] = "auto"
    transfer_timeout_s: float = Field(10.0, gt=0)
    lease_ttl_s: float = Field(30.0, gt=0)
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0, description="structured output: a grammar (json_schema, regex, EBNF, tools) whose compile on a "
                                "replica takes more CPU seconds fails its request with a 400 naming this limit")
    grammar_compile_workers: int = Field(2, ge=1, description="grammar compile worker processes per replica")
    fallback_to_colocated: bool = False
    max_failovers: int = Field(2, ge=0, description="times one request may resume on another replica after "
                                                    "losing its own (death, broken stream, stall); then an "
                                                    "error event naming the cause.  0: never")
    trace_file: str | None = Field(
        None, description="the JSONL span file every process of the cluster writes; None: $PDCLUSTER_TRACE_FILE, "
                          "else runs/traces/spans.jsonl; off: no file (OTLP exporters are set by OTEL_* variables)")
    fault_injection: bool = Field(
        False, description="test hook: the gateway honours a request's x-pdcluster-fault header "
                           "(pdcluster/services/pools/faults.py); also on with PDCLUSTER_FAULTS=1 in its environment")
    host: str = "127.0.0.1"
    port: int = 8000
    ingress: Literal["gateway", "serve_proxy"] = Field(
        "gateway", description="gateway: the gateway replica serves HTTP on host:port itself, no Serve proxy "
                               "(one Serve hop less per streamed token); serve_proxy: Serve's HTTP proxy in front")
    token_channel: bool = Field(
        True, description="engine replicas send streamed tokens to the gateway over one authenticated TCP "
                          "connection each (pdcluster/services/token_channel.py) instead of one Serve streaming "
                          "item per token; Serve still carries each call, its errors and cancellation.  false: "
                          "every token through Serve")
    max_body_bytes: int = Field(1 * 2**20, ge=1024)
    shutdown_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM or Ctrl-C, `pdcluster up` drains the "
                                                            "gateway first: new requests get 503, /ready fails, "
                                                            "streams in flight get this long to finish.  0: stop "
                                                            "at once")
    autoscaling: AutoscalingSettings = AutoscalingSettings()
    # API keys: from here, api_key_file and PDCLUSTER_API_KEY together.  Only
    # their digests are dumped (deployment args, the state file); the clear
    # keys stay in the process that read them (its readiness probe uses one).
    api_keys: tuple[SecretStr, ...] = Field(
        (), exclude=True, repr=False, description="keys clients send as `Authorization: Bearer <key>`; with any "
                                                  "key (or digest) set, every /v1 request needs one")
    api_key_file: str | None = Field(None, exclude=True, description="one key per line; blank lines and "
                                                                     "# comments are skipped")
    api_key_digests: tuple[str, ...] = Field(
        (), repr=False, description="sha256:<hex> of each accepted key: filled from the three sources above, "
                                    "or given directly to keep the keys themselves out of config files")
    insecure_no_auth: bool = Field(False, description="serve a non-loopback host without API keys anyway")
    tenants: tuple[TenantSettings, ...] = Field((), description="named groups of API keys, each with its own "
                                                                 "rate limits; a key of no tenant is tenant 'default'")
    tenant_header: bool = Field(False, description="trust the client's x-pdcluster-tenant header (only behind a "
                                                   "gateway that sets it): it names the tenant")
    topology: TopologySettings = TopologySettings()

    @model_validator(mode="before")
    @classmethod
    def _gather_api_keys(cls, data: Any) -> Any:
        """Folds api_key_file and PDCLUSTER_API_KEY into ``api_keys``, and
        every key into ``api_key_digests``."""
        if not isinstance(data, dict):
            return data
        given = data.get("api_keys") or ()
        if isinstance(given, (str, SecretStr)):
            given = (given,)
        keys = [_checked_key(k, f"api_keys[{n}]") for n, k in enumerate(given)]
        if data.get("api_key_file"):
            keys += _file_keys(str(data["api_key_file"]))
        keys += _env_keys()
        keys = list(_unique([k.get_secret_value() for k in keys]))
        digests = list(data.get("api_key_digests") or ())
        for n, digest in enumerate(digests):
            if not is_api_key_digest(digest):
                raise ValueError(f"api_key_digests[{n}] is not `sha256:<64 lowercase hex digits>` (the hex is what "
                                 "`printf %s \"$KEY\" | sha256sum` prints), or list the key itself under api_keys")
        tenants = tuple(t if isinstance(t, TenantSettings) else TenantSettings.model_validate(t)
                        for t in data.get("tenants") or ())
        names = [t.name for t in tenants]
        if len(set(names)) != len(names) or DEFAULT_TENANT in names:
            raise ValueError(f"tenant names must be unique and not {DEFAULT_TENANT!r} (the tenant of other keys)")
        if sum(t.kv_guaranteed for t in tenants) > 1:
            raise ValueError("the tenants' kv_guaranteed shares add up to more than 1: lower them")
        for t in tenants:
            if t.kv_guaranteed > t.kv_max:
                raise ValueError(f"tenant {t.name!r}: kv_guaranteed ({t.kv_guaranteed}) is over its kv_max "
                                 f"({t.kv_max}): lower it or raise kv_max")
        tenant_digests = [d for t in tenants for d in t.api_key_digests]
        if len(set(tenant_digests)) != len(tenant_digests):
            raise ValueError("an API key belongs to two tenants: give each key to one tenant")
        return {**data, "api_keys": tuple(SecretStr(k) for k in keys), "tenants": tenants,
                "api_key_digests": _unique(digests + [api_key_digest(k) for k in keys] + tenant_digests)}

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        EngineConfig(block_size=self.block_size)  # raises ValueError naming the fix
        self.speculative.engine()                 # likewise (ngram_min <= ngram_max, draft_model for draft)
        if self.scheduler.kv_watermark_low > self.scheduler.kv_watermark_high:
            raise ValueError("scheduler.kv_watermark_low must be <= kv_watermark_high")
        serving = self.decode if self.mode == "disaggregated" else self.colocated
        if serving.num_replicas < 1 and serving.autoscaling is None:
            raise ValueError(f"{'decode' if self.mode == 'disaggregated' else 'colocated'}.num_replicas must be >= 1: "
                             "that pool serves every stream (only prefill.num_replicas may be 0)")
        if self.autoscaling.enabled and self.mode != "disaggregated":
            raise ValueError("autoscaling sizes the prefill and decode pools apart: it needs mode disaggregated "
                             "(for colocated, give colocated.autoscaling a Ray Serve autoscaling_config instead)")
        problem = exposure_problem(self.host, bool(self.api_key_digests), self.insecure_no_auth)
        if problem:
            raise ValueError(problem)
        problem = internal_exposure_problem(self.topology, self.index_url)
        if problem:
            raise ValueError(problem)
        return self

    def client_api_key(self) -> str | None:
        """A key this process can authenticate with (its own readiness probe);
        None when auth is off, or when only digests are known here."""
        return self.api_keys[0].get_secret_value() if self.api_keys else None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict | None = None,
                  default_layout: dict | None = None) -> "ClusterConfig":
        """``overrides``: top-level keys that win over the file's (command-line flags);
        ``default_layout``: pool fields used when the file names no layout (none of LAYOUT_KEYS)."""
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of config keys at the top level")
        if "applications" in data:
            raise ValueError(f"{path} is a Ray Serve config (`applications:`), for `serve run {path}`; "
                             "`pdcluster up --config` takes a cluster config: the keys under the pdcluster "
                             "application's `args:` at the top level (see deploy/race.yaml)")
        if default_layout and not LAYOUT_KEYS & data.keys():
            data = {**default_layout, **data}
        return cls.model_validate({**data, **(overrides or {})})

    def resume_local_max_tokens(self) -> int:
        """router.resume_local_max_tokens, its default resolved: a stream whose
        fresh prompt of that size the decode replica would prefill itself may
        recompute as much there after a failover; without conditional
        disaggregation, one prefill chunk (one step's stall for the replica's
        other streams)."""
        r = self.router
        if r.resume_local_max_tokens is not None:
            return r.resume_local_max_tokens
        return r.local_prefill_max_tokens or self.scheduler.prefill_chunk_size

    def engine_config(self, pool: PoolConfig, replica: str = "engine") -> EngineConfig:
        """``replica``: names the replica's own disk-tier directory."""
        return EngineConfig(
            model=self.model, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype, weight_dtype=self.weight_dtype,
            block_size=self.block_size,
            kv_cache_bytes=pool.kv_cache_mib * 2**20, max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, lease_ttl_s=self.lease_ttl_s,
            num_threads=pool.num_threads,
            grammar_compile_workers=self.grammar_compile_workers,
            grammar_compile_timeout_s=self.grammar_compile_timeout_s,
            # Prefill replicas never decode past the first token: nothing to draft.
            speculative=SpeculativeConfig() if pool is self.prefill else self.speculative.engine(),
            kv_quotas=tuple((t.name, t.kv_guaranteed, t.kv_max) for t in self.tenants
                            if t.kv_guaranteed > 0 or t.kv_max < 1),
            scheduler=self._scheduler_config(pool), kv_tiers=self.kv_tiers.engine(replica))

    def _scheduler_config(self, pool: PoolConfig) -> SchedulerConfig:
        """A replica that decodes (a decode replica, a colocated one) takes at most
        ``decode_step_prefill_tokens`` of prompt per step beside its decodes."""
        s = self.scheduler
        batched, chunk = s.max_num_batched_tokens, s.prefill_chunk_size
        if self.mode == "colocated" or pool is self.decode:
            batched = min(batched, s.max_num_seqs + s.decode_step_prefill_tokens)
            chunk = min(chunk, s.decode_step_prefill_tokens)
        elif self.mode == "disaggregated" and pool is self.prefill:
            # Nothing decodes there: the oldest prompt takes the whole step, so prompts finish in
            # arrival order (as admission's speed model assumes) instead of side by side, each later.
            chunk = batched
        decodes = self.mode == "colocated" or pool is self.decode
        return SchedulerConfig(max_num_seqs=s.max_num_seqs, max_num_batched_tokens=batched, prefill_chunk_size=chunk,
                               borrowed_prefill_tokens=s.borrowed_prefill_tokens,
                               # a lone prompt, or streams that can afford a longer step (engine/step_limits.py)
                               wide_step_tokens=s.max_num_batched_tokens if decodes else 0,
                               wide_step_tpot_s=self.admission.tpot_slo_s * self.admission.ttft_headroom
                               if decodes else 0.0,
                               long_prefill_tokens=s.long_prefill_tokens if decodes else 0,
                               kv_watermark_high=s.kv_watermark_high, kv_watermark_low=s.kv_watermark_low,
                               tenant_weights=tuple((t.name, t.weight) for t in self.tenants if t.weight != 1))
