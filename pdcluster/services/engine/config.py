"""The engine's own knobs: a frozen dataclass that refuses bad values.
(The user-facing pydantic config in pdcluster/services/config.py maps onto this.)"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64              # running requests at most
    max_num_batched_tokens: int = 1024  # tokens per step (decode + prefill chunks)
    prefill_chunk_size: int = 512       # prompt tokens of one request per step
    # Prompt tokens a step takes while the replica computes on a neighbour's cores
    # (pools/core_lending.py): it hands them back between steps, so a short step hands them
    # back sooner.  128: a 2,900-token prompt prefilled in 128-token steps ran at 431 tok/s,
    # in 1024-token steps at 403-454 (2 AVX2 threads, 2026-12-04), a step then 0.3 s vs 2.4 s.
    # At least this many: as many as the replica computes in 0.3 s where that is more
    # (engine/step_limits.py; on AMX 128-token steps cost a third more a token).
    borrowed_prefill_tokens: int = 128
    # Tokens a step may take past the caps above, as many as the replica computes in 0.3 s
    # (engine/step_limits.py): when its one request is a prompt (nothing decodes, nothing
    # waits), or, with wide_step_tpot_s set, while every stream it decodes can still end
    # within that mean TPOT.  Longer steps cost less a token where the kernels are fast
    # (2-core Sapphire Rapids: a lone 3,072-token prompt 1.0 s against 1.1 s in 256-token
    # steps, 2026-12-06).  0: no longer steps.
    wide_step_tokens: int = 0
    # The mean TPOT the streams keep when a step goes wide beside them (the cluster: its TPOT
    # SLO x admission headroom on a replica that decodes).  0: only a lone prompt widens a step.
    wide_step_tpot_s: float = 0.0
    # Prompts with more than this many tokens left to compute yield to shorter ones: a step
    # schedules the short prefills first and gives what is left to at most max_long_prefills
    # long ones, so a short chat is not queued behind a 3,000-token prompt.  0: arrival order.
    long_prefill_tokens: int = 0
    max_long_prefills: int = 1
    kv_watermark_high: float = 0.97     # stop admitting above this KV usage ...
    kv_watermark_low: float = 0.90      # ... until usage falls below this
    tenant_weights: tuple[tuple[str, float], ...] = ()  # (tenant, weight): fair shares (fair_queue.py); absent: 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 1 <= self.prefill_chunk_size:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}")
        if self.wide_step_tokens < 0:
            raise ValueError(f"wide_step_tokens must be >= 0 (0: no longer steps), got {self.wide_step_tokens}")
        if not self.wide_step_tpot_s >= 0:  # NaN fails too; inf: every stream affords any width
            raise ValueError(f"wide_step_tpot_s must be a number >= 0 (0: off), got {self.wide_step_tpot_s}")
        if not 1 <= self.borrowed_prefill_tokens:
            raise ValueError(f"borrowed_prefill_tokens must be >= 1, got {self.borrowed_prefill_tokens}")
        if self.long_prefill_tokens < 0:
            raise ValueError(f"long_prefill_tokens must be >= 0 (0: arrival order), got {self.long_prefill_tokens}")
        if self.max_long_prefills < 1:
            raise ValueError(f"max_long_prefills must be >= 1, got {self.max_long_prefills}")
        if not 0 < self.kv_watermark_low <= self.kv_watermark_high <= 1:
            raise ValueError(
                f"need 0 < kv_watermark_low ({self.kv_watermark_low}) <= kv_watermark_high "
                f"({self.kv_watermark_high}) <= 1")
        for tenant, weight in self.tenant_weights:
            if not 0.001 <= weight <= 1000:
                raise ValueError(f"tenant {tenant!r}: weight must be from 0.001 to 1000, got {weight!r}")


SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (spec_decode.py): drafts by n-gram prompt lookup
    (spec_ngram.py) or by a draft model (spec_draft.py).  Off by default: it
    pays where the drafts get accepted and costs a little elsewhere (the
    back-off bounds that cost)."""
    method: str = "none"                # "none" | "ngram" | "draft"
    num_tokens: int = 4                 # k: tokens proposed per step
    ngram_min: int = 2                  # match the context's last n tokens, n from max down to min
    ngram_max: int = 4
    min_acceptance: float = 0.3         # back off a request whose acceptance over a window is lower
    window_tokens: int = 16             # proposed tokens per acceptance window
    draft_model: str | None = None      # method draft: a model path, or "default" (the bundled model)
    draft_num_layers: int | None = None  # method draft: the draft's first N decoder layers only (early exit)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"speculative num_tokens must be in [1, 16], got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({self.ngram_min}) <= ngram_max ({self.ngram_max})")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if self.window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {self.window_tokens}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.method draft needs speculative.draft_model: a model path, or 'default' "
                             "for the bundled model (with draft_num_layers N for a cheaper early-exit draft)")
        if self.method != "draft" and (self.draft_model is not None or self.draft_num_layers is not None):
            raise ValueError(f"speculative.draft_model and draft_num_layers apply to method draft only "
                             f"(method is {self.method!r}): set method: draft, or drop them")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"speculative.draft_num_layers must be >= 1 (the draft's first N decoder layers), "
                             f"got {self.draft_num_layers}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class KVTierConfig:
    """Tiers under the device pool (kv_tiers.py): evicted full blocks go to
    host memory, then to disk, and come back on a prefix match instead of
    being recomputed.  Off by default in the engine; the pools turn it on
    with a directory per replica under the run dir."""
    enabled: bool = False
    host_bytes: int | None = None       # None: min(8 x the device pool, 1/4 of available memory)
    disk_dir: str | None = None         # None: no disk tier
    disk_bytes: int | None = None       # None: 1/5 of the free space where disk_dir lives

    def __post_init__(self) -> None:
        if self.host_bytes is not None and self.host_bytes < 1:
            raise ValueError(f"kv_tiers.host_bytes must be > 0 (the disk tier is written from the host tier), "
                             f"got {self.host_bytes}: raise it, or set kv_tiers.enabled false")
        if self.disk_bytes is not None and self.disk_bytes < 1:
            raise ValueError(f"kv_tiers.disk_bytes must be > 0, got {self.disk_bytes}: raise it, "
                             "or leave kv_tiers.disk_dir unset for no disk tier")
        if self.disk_bytes is not None and self.disk_dir is None:
            raise ValueError("kv_tiers.disk_bytes is set but kv_tiers.disk_dir is not: name the directory")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None            # None -> the bundled SmolLM2-135M-Instruct GGUF
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"        # auto (the model's dtype) | bf16 | int8 | fp8_e4m3 (kernels/kv_quant.py)
    weight_dtype: str = "auto"          # auto (the model's dtype) | int8 (decoder projections: model/weight_quant.py)
    device: str = "cpu"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 2**20   # memory for the KV pool
    num_kv_blocks: int | None = None    # overrides kv_cache_bytes when set
    max_model_len: int | None = None    # None -> the model's context
    enable_prefix_caching: bool = True
    # Output positions recomputed (a resumed or preempted request) run as decode
    # rows, so they get the original decode steps' K/V and logits bit for bit
    # (runner.py build_batch); off: one prefill pass, and in bf16 a near-tie
    # after the hop may flip (bench/micro/resume_identity.py).  fp32 models
    # always take the one pass (engine.replays_output).
    exact_resume: bool = True
    lease_ttl_s: float = 30.0           # prefill-only blocks stay pinned this long at most
    num_threads: int | None = None      # torch intra-op threads; None leaves torch's default
    # Structured output: grammar compiles run in this many worker processes, each killed past the
    # limit in CPU seconds (the request gets a 400 naming it); see grammar_pool.py.
    grammar_compile_workers: int = 2
    grammar_compile_timeout_s: float = 10.0
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    # (tenant, guaranteed share, maximum share) of the KV blocks (kv_quota.py); none: plain LRU
    kv_quotas: tuple[tuple[str, float, float], ...] = ()
    kv_tiers: KVTierConfig = KVTierConfig()

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.kv_cache_dtype not in ("auto", "bf16", "int8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto, bf16, int8 or fp8_e4m3, got {self.kv_cache_dtype!r}")
        if self.weight_dtype not in ("auto", "int8"):
            raise ValueError(f"weight_dtype must be auto or int8, got {self.weight_dtype!r}")
        if self.weight_dtype != "auto" and self.dtype not in ("bfloat16", "bf16"):
            raise ValueError(f"weight_dtype {self.weight_dtype} runs with dtype bfloat16, got {self.dtype!r}: "
                             f"set dtype: bfloat16, or weight_dtype: auto")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        for tenant, guaranteed, maximum in self.kv_quotas:
            if not 0 <= guaranteed <= maximum <= 1:
                raise ValueError(f"tenant {tenant!r}: need 0 <= kv_guaranteed ({guaranteed}) <= kv_max ({maximum}) <= 1")
        if sum(g for _, g, _ in self.kv_quotas) > 1:
            raise ValueError("the tenants' kv_guaranteed shares add up to more than 1: lower them")
        if self.kv_tiers.enabled and self.device != "cpu":
            raise ValueError(f"kv_tiers run on a CPU pool only for now (device is {self.device!r}): "
                             "set kv_tiers.enabled false")
        if self.grammar_compile_workers < 1:
            raise ValueError(f"grammar_compile_workers must be >= 1, got {self.grammar_compile_workers}")
        if not 0 < self.grammar_compile_timeout_s < float("inf"):
            raise ValueError(f"grammar_compile_timeout_s must be a finite number of seconds > 0, "
                             f"got {self.grammar_compile_timeout_s}")
