"""The synchronous engine: ``add_request`` -> ``step`` (schedule, run,
post-process) -> ``RequestOutput``s; ``abort`` at any time.  Also the two
disaggregation hooks: prefill-only requests whose blocks stay leased, and
requests whose prompt K/V is written from outside (reserved blocks that
expire if the K/V never comes).

No request can hurt another: a request whose logits are not finite, or
whose post-processing raises, fails alone; a step that raises fails the
requests it scheduled.  Each failed request ends with an output carrying
``error`` (finish_reason ABORT), its blocks go back, and the engine goes on.
Only when the failure is not one request's (the KV bookkeeping no longer
adds up, or several steps in a row fail) does ``step`` raise EngineDeadError.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from pdcluster.kernels import ops
from pdcluster.kernels.kv_quant import is_quantized, pool_dtype

from pdcluster.services.engine.config import EngineConfig
from pdcluster.services.engine.detokenizer import IncrementalDetokenizer
from pdcluster.services.engine_errors import EngineDeadError, InvalidRequestError, RequestTooLongError, UnknownRequestError
from pdcluster.services.engine.grammar import GrammarCache
from pdcluster.services.engine.kv_cache import KVCache, KVCacheSpec, KVEventCallback
from pdcluster.services.engine.kv_quota import KVQuota, largest_charges
from pdcluster.services.engine.kv_tiers import KVTiers, TierEventCallback
from pdcluster.services.engine.lease import LeaseTable
from pdcluster.services.engine.model.k_smoothing import calibration_token_ids, k_smoothing_shift
from pdcluster.services.engine.model.loader import LoadedModel, block_hash_seed, load_model
from pdcluster.services.engine.output_history import check_prior_output, replay_prior_output
from pdcluster.services.engine.peer_import import LandedImport, PeerImports, lend_blocks
from pdcluster.services.engine.outputs import EngineStats, ExternalKVAllocation, PrefillResult, RequestOutput
from pdcluster.services.engine.request import FinishReason, Request
from pdcluster.services.engine.runner import ModelRunner
from pdcluster.services.engine.sampler import SampleResult
from pdcluster.services.sampling_params import SamplingParams, StreamDraw
from pdcluster.services.engine.scheduler import Scheduler, SchedulerOutput
from pdcluster.services.engine.spec_decode import Speculator
from pdcluster.services.engine.spec_draft import build_draft_proposer
from pdcluster.services.model_cache import derived_dir

log = logging.getLogger(__name__)
# Steps that raise, in a row, before the engine gives up: one bad request
# fails one step; a fault that outlives the requests it failed is not theirs.
MAX_CONSECUTIVE_FAILED_STEPS = 3
# An engine whose only unfinished requests wait for tier loads waits this long for one to land
# instead of spinning (it never waits while there is a batch to run).
_TIER_LOAD_WAIT_S = 0.005


def kv_spec_for(config: EngineConfig, loaded: LoadedModel) -> KVCacheSpec:
    mc = loaded.config
    dtype = pool_dtype(config.kv_cache_dtype, next(loaded.model.parameters()).dtype)
    probe = KVCacheSpec(1, config.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
    num_blocks = config.num_kv_blocks or config.kv_cache_bytes // probe.block_bytes
    return KVCacheSpec(num_blocks, config.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)


def replays_output(config: EngineConfig, model: torch.nn.Module) -> bool:
    """Whether recomputed output positions run decode-shaped (runner.py):
    below fp32 only.  In fp32 one prefill pass already gives the original's
    tokens (test_engine_resume.py), and the fp32 path's torch decode
    attention gathers a row's whole context per replayed position."""
    return config.exact_resume and next(model.parameters()).dtype is not torch.float32


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None,
                 on_kv_event: KVEventCallback | None = None, on_tier_event: TierEventCallback | None = None):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = loaded or load_model(config.model, config.dtype, config.device, config.weight_dtype)
        if self.loaded.weight_dtype != config.weight_dtype:
            raise ValueError(f"the model was loaded with weight_dtype {self.loaded.weight_dtype}, the engine is "
                             f"configured for {config.weight_dtype}: load it with the engine's weight_dtype")
        self.loaded.model.pack_weights(screen_dir=derived_dir())
        # The native kernels run on their own work pool; torch's OpenMP team
        # would spin beside it, so torch ops inside a native step get one thread.
        self._native = self.loaded.model.native_stack is not None
        self.compute_threads = config.num_threads or torch.get_num_threads()
        self.own_threads = self.compute_threads   # more than this: computing on borrowed cores
        # Asked before every step for the native kernels' threads (a replica borrowing idle
        # cores: pdcluster/services/pools/core_lending.py); None: compute_threads stays.
        self.threads_source: Callable[[], int] | None = None
        if self._native:
            ops.set_native_threads(self.compute_threads)
        self.tokenizer = self.loaded.tokenizer
        mc = self.loaded.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.kv_spec = kv_spec_for(config, self.loaded)
        if is_quantized(self.kv_spec.dtype) and self.loaded.model.k_shift is None:  # computed once per load
            self.loaded.model.k_shift = k_smoothing_shift(self.loaded.model, calibration_token_ids(self.tokenizer))
        self.hash_seed = block_hash_seed(self.loaded.weights_id, self.kv_spec.dtype, config.block_size,
                                         config.weight_dtype)
        self.kv = KVCache(self.kv_spec, config.device, on_kv_event, config.enable_prefix_caching,
                          KVQuota.of_shares(config.kv_quotas, self.kv_spec.num_blocks))
        self.tiers = None  # host and disk tiers under the pool (kv_tiers.py)
        if config.kv_tiers.enabled and config.enable_prefix_caching:
            self.tiers = KVTiers(config.kv_tiers, self.kv, self.hash_seed, on_tier_event)
            self.kv.on_evict = self.tiers.on_evict
        self.speculator = self._speculator() if config.speculative.enabled else None
        self.scheduler = Scheduler(config.scheduler, self.kv, self.hash_seed, self.speculator, self.tiers)
        self.requests: dict[str, Request] = {}
        # The sampler reads a penalised request's tokens from this table, by id.
        self.runner = ModelRunner(self.loaded.model, self.kv, config.device,
                                  eos_token_ids=tuple(self.tokenizer.eos_token_ids), histories=self.requests,
                                  exact_resume=replays_output(config, self.loaded.model))
        # Structured output: grammars compiled once per spec, over this engine's tokenizer (grammar.py).
        self.grammars = GrammarCache(self.tokenizer, mc.vocab_size, compile_workers=config.grammar_compile_workers,
                                     compile_timeout_s=config.grammar_compile_timeout_s)
        self.runner.sampler.grammar.bind(self.grammars)
        self.leases = LeaseTable(self.kv.free, config.lease_ttl_s)
        self.peer_imports = PeerImports(self.kv, self.hash_seed)  # prefix blocks a peer pull fills (peer_import.py)
        # A reservation waits at most as long as the lease it will pull from.
        self.reservation_ttl_s = config.lease_ttl_s
        self._reservation_expiry: dict[str, float] = {}  # request id -> time.monotonic()
        # key -> blocks a transfer may still write into (quarantine / release_quarantine)
        self._quarantine: dict[int, list[int]] = {}
        self._quarantine_key = 0
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._in_flight: list[Request] | None = None  # this step's requests, once scheduled
        self._step_outputs: list[RequestOutput] = []
        self.num_steps = 0
        self.num_failed_requests = 0
        self.num_failed_steps = 0
        self.num_expired_reservations = 0
        self._consecutive_failed_steps = 0

    def _speculator(self) -> Speculator:
        spec = self.config.speculative
        if spec.method == "draft":
            return Speculator(spec, build_draft_proposer(spec, self.loaded, self.config.dtype, self.config.device,
                                                         self.max_model_len))
        return Speculator(spec)

    @property
    def awaiting_kv(self) -> Mapping[str, Request]:
        """Reserved requests whose prompt K/V is coming from outside (read-only: the scheduler's)."""
        return MappingProxyType(self.scheduler.awaiting_kv)

    # ---- intake --------------------------------------------------------
    def _make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                      prefill_only: bool = False, block_hashes: Sequence[int] = (), grammar: Any = None,
                      draw: StreamDraw | None = None) -> Request:
        """``block_hashes``: the prompt's full blocks' hashes as the gateway
        computed them (same seed and block size: the gateway checks the seed at
        start-up); taken as they are for lookup, the rest is hashed here on
        demand.  A hit is used only when the cached block's tokens equal the
        prompt's (kv_cache.py): a wrong or colliding hash costs a recompute.
        ``grammar``: ``params.guided`` compiled (see grammar_for).  ``draw``: this stream's
        seed and prompt logprobs where they differ from ``params`` (StreamDraw)."""
        if request_id in self.requests or request_id in self.awaiting_kv:
            raise InvalidRequestError(f"request id {request_id!r} is already in use; pick a unique id")
        if prefill_only and self.leases.get(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} still holds the lease of an earlier prefill; "
                                      "pick a unique id, or release that lease first")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(ids, params)
        grammar = self.grammar_for(params, grammar)
        if len(block_hashes) > len(ids) // self.kv_spec.block_size:
            raise InvalidRequestError(f"{len(block_hashes)} block hashes for a prompt of {len(ids)} tokens "
                                      f"({len(ids) // self.kv_spec.block_size} full blocks): hash full blocks only")
        return Request(request_id, ids, params, prefill_only=prefill_only, block_hashes=list(block_hashes),
                       grammar=grammar, draw=draw)

    def grammar_for(self, params: SamplingParams, grammar: Any = None) -> Any:
        """The compiled grammar a guided request carries: the one its caller
        compiled (AsyncEngine does, off this thread, at admission), else the
        cache's.  Compiles here only for a caller that drives the engine
        itself (no engine thread); on AsyncEngine's thread that raises
        (GrammarCache.compile), so a step never waits on a compile."""
        if params.guided is None or grammar is not None:
            return grammar
        cached = self.grammars.get(params.guided)
        return cached if cached is not None else self.grammars.compile(params.guided)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises a typed error naming the fix if the request can never run."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty: send at least one token")
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad!r} is outside this model's vocabulary [0, {vocab})")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias names token id {bad}, outside this model's vocabulary "
                                      f"[0, {vocab}): remove it")
        if n >= self.max_model_len:
            raise RequestTooLongError(
                f"prompt has {n} tokens; this model's context is {self.max_model_len}: shorten it")
        if n + params.max_tokens > self.max_model_len:
            raise RequestTooLongError(
                f"prompt has {n} tokens and max_tokens is {params.max_tokens}, together {n + params.max_tokens}; "
                f"this model's context is {self.max_model_len}: lower max_tokens to at most {self.max_model_len - n}")
        blocks = -(-(n + params.max_tokens) // self.kv_spec.block_size)
        if blocks > self.kv_spec.num_blocks:
            raise RequestTooLongError(
                f"prompt + max_tokens need {blocks} KV blocks but the pool has {self.kv_spec.num_blocks}: "
                "lower max_tokens, shorten the prompt, or raise kv_cache_bytes")

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    prefill_only: bool = False, prior_output_token_ids: Sequence[int] = (),
                    block_hashes: Sequence[int] = (), grammar: Any = None, draw: StreamDraw | None = None) -> Request:
        """``prior_output_token_ids``: a resumed request's output so far (another
        replica generated it); it counts as output, not prompt (output_history.py).
        ``block_hashes``, ``grammar``, ``draw``: see _make_request."""
        if prior_output_token_ids:
            check_prior_output(prior_output_token_ids, params.max_tokens, self.loaded.config.vocab_size)
        req = self._make_request(request_id, prompt, params, prefill_only, block_hashes, grammar, draw)
        self.requests[request_id] = req
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        replay_prior_output(self._detok[request_id], prior_output_token_ids, params.ignore_eos,
                            self.tokenizer.eos_token_ids)
        self.scheduler.add(req, prior_output_token_ids)
        return req

    # ---- disaggregation: K/V written from outside ------------------------
    def reserve_external(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                         ttl_s: float | None = None, block_hashes: Sequence[int] = (),
                         prior_output_token_ids: Sequence[int] = (), grammar: Any = None,
                         draw: StreamDraw | None = None) -> ExternalKVAllocation | None:
        """Allocates blocks for a prompt whose K/V someone else computed.
        None if the pool cannot hold it now (retry later).  Unless committed
        within ``ttl_s`` (default ``reservation_ttl_s``), the reservation is
        aborted and its blocks freed.  ``prior_output_token_ids``: a resumed
        request's output so far, whose K/V the prefill side computed after the
        prompt's; it counts as output, as in add_request (output_history.py)."""
        if ttl_s is not None and not 0 < ttl_s < float("inf"):
            raise InvalidRequestError(f"ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")
        if prior_output_token_ids:
            check_prior_output(prior_output_token_ids, params.max_tokens, self.loaded.config.vocab_size)
        req = self._make_request(request_id, prompt_token_ids, params, block_hashes=block_hashes, grammar=grammar,
                                 draw=draw)
        req.output_token_ids.extend(prior_output_token_ids)  # a fresh request: the scheduler reserves all its tokens
        num_cached_blocks = self.scheduler.reserve_external(req)
        if num_cached_blocks is None:
            return None
        self._reservation_expiry[request_id] = time.monotonic() + (ttl_s or self.reservation_ttl_s)
        return ExternalKVAllocation(request_id, tuple(req.block_ids), num_cached_blocks)

    def commit_external(self, request_id: str, first_token_id: int) -> Request:
        """The reserved blocks now hold the K/V of the prompt (and of a
        resumed request's prior output): decode from ``first_token_id``
        (already sent to the client by the prefill side)."""
        vocab = self.loaded.config.vocab_size
        if isinstance(first_token_id, bool) or not isinstance(first_token_id, int) or not 0 <= first_token_id < vocab:
            raise InvalidRequestError(
                f"first token id {first_token_id!r} is outside this model's vocabulary [0, {vocab})")
        req = self.scheduler.commit_external(request_id, first_token_id)
        self._reservation_expiry.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(f"no reserved request {request_id!r} (never reserved, aborted, or expired "
                                      "before the K/V came): call reserve_external again")
        self.requests[request_id] = req
        detok = IncrementalDetokenizer(self.tokenizer, req.params.stop)
        self._detok[request_id] = detok
        # The client has the prior output's text and the first token's: replayed, so stop
        # strings and the text deltas that follow continue from them.
        replay_prior_output(detok, req.output_token_ids[:-1], req.params.ignore_eos, self.tokenizer.eos_token_ids)
        detok.add(first_token_id)
        reason = self._stop_reason(req, first_token_id, detok)
        if reason is not None:
            self._finish(req, reason)
            self._forget(request_id)
        return req

    def expire_stale(self, now: float | None = None) -> None:
        """The periodic pass (every step, and every idle wake of the async
        loop): leases past their grace, reservations past their TTL, and
        tier loads that landed (an aborted request's blocks go back even while idle)."""
        self.leases.expire(now)
        if self.tiers is not None:
            self.scheduler.land_tier_loads()
        if self._reservation_expiry:
            now = time.monotonic() if now is None else now
            for request_id in [rid for rid, at in self._reservation_expiry.items() if at <= now]:
                self.abort(request_id)
                self.num_expired_reservations += 1
                log.warning("reservation expired before its KV came: request_id=%s", request_id)

    def quarantine(self, request_id: str, block_ids: Sequence[int]) -> int | None:
        """Aborts the reservation of ``request_id`` but holds ``block_ids`` (of its
        blocks) out of the free list and the prefix cache: a transfer into them
        failed without being confirmed stopped, so bytes may still land there.
        Returns the key that release_quarantine takes once the transfer settled;
        None when nothing is reserved under that id (its blocks were already freed)."""
        req = self.scheduler.awaiting_kv.get(request_id)
        if req is None:
            return None
        wanted = set(block_ids)
        held = [b for b in req.block_ids if b in wanted]
        req.block_ids = [b for b in req.block_ids if b not in wanted]  # the rest go back with the abort
        self.abort(request_id)
        self._quarantine_key += 1
        self._quarantine[self._quarantine_key] = held
        log.warning("quarantined %d blocks of request %s until its transfer settles", len(held), request_id)
        return self._quarantine_key

    def release_quarantine(self, key: int) -> int:
        """The transfer into a quarantine's blocks has settled: they go back. Returns how many."""
        held = self._quarantine.pop(key, [])
        if held:
            self.kv.free(held)
        return len(held)

    # ---- peer prefix fetch (peer_import.py; pdcluster/services/pools/peer_fetch.py) --------
    def local_prefix_blocks(self, block_hashes: Sequence[int], token_ids: Sequence[int]) -> int:
        """Leading blocks of a prompt this replica holds: in its pool, then in its tiers."""
        match = self.kv.match_prefix(block_hashes, token_ids)
        if self.tiers is None:
            return match.num_blocks
        return match.num_blocks + len(self.tiers.lookup(block_hashes, token_ids, match.num_blocks))

    def stage_for_lending(self, key: str, block_hashes: Sequence[int], token_ids: Sequence[int]) -> int:
        """Before a peer's lease: the prompt's blocks this replica holds only in its tiers go back
        into its pool (scheduler.stage_tier_blocks), so ``lease_prefix`` can lend them.  Returns the
        blocks still loading under ``key`` (0: nothing to wait for; ``tier_blocks_loading`` asks again)."""
        if self.tiers is None:
            return 0
        return self.scheduler.stage_tier_blocks(key, block_hashes, token_ids)

    def tier_blocks_loading(self, key: str) -> bool:
        """Lands the tier loads that finished; whether the one under ``key`` is still loading."""
        if self.tiers is None:
            return False
        self.scheduler.land_tier_loads()
        return self.tiers.is_loading(key)

    def lease_prefix(self, lease_id: str, block_hashes: Sequence[int], token_ids: Sequence[int],
                     start: int) -> tuple[tuple[int, ...], float] | None:
        """The holder's side of a peer's pull (peer_import.lend_blocks): what its pool holds, tier
        blocks included once ``stage_for_lending`` brought them back."""
        return lend_blocks(self.kv, self.leases, lease_id, block_hashes, token_ids, start)

    def land_peer_import(self, key: str, block_hashes: Sequence[int], token_ids: Sequence[int],
                         start: int) -> LandedImport:
        return self.peer_imports.land(key, block_hashes, token_ids, start)

    def quarantine_peer_import(self, key: str) -> int | None:
        """A pull into ``key``'s blocks is in doubt: they stay out of reuse until
        release_quarantine (see quarantine).  None when ``key`` holds nothing."""
        held = self.peer_imports.take(key)
        if not held:
            return None
        self._quarantine_key += 1
        self._quarantine[self._quarantine_key] = held
        log.warning("quarantined %d peer-import blocks of %s until their transfer settles", len(held), key)
        return self._quarantine_key

    # ---- leases (prefill side) --------------------------------------------
    def release_lease(self, request_id: str) -> bool:
        return self.leases.release(request_id)

    def shorten_lease(self, request_id: str, ttl_s: float, prefill: PrefillResult) -> PrefillResult:
        """Makes the lease end ``ttl_s`` from now (never later than it would);
        returns ``prefill`` with the new deadline.  A fault-injection hook."""
        lease = self.leases.shorten(request_id, ttl_s)
        if lease is None:
            raise UnknownRequestError(f"no lease {request_id!r}: it was released or has expired")
        return dataclasses.replace(prefill, lease_deadline_unix=lease.deadline_unix)

    # ---- control ----------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        self._reservation_expiry.pop(request_id, None)
        req = self.scheduler.awaiting_kv.get(request_id) or self.requests.get(request_id)
        if req is None:
            return self.leases.release(request_id)
        if not req.is_finished:
            self.scheduler.finish(req, FinishReason.ABORT)
        self._forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def set_compute_threads(self, n: int) -> None:
        """Threads the native kernels compute with from their next call on
        (a replica borrowing idle cores: pdcluster/services/pools/core_lending.py).
        The kernels split work by output rows, so results do not depend on it."""
        self.compute_threads = max(int(n), 1)
        self.scheduler.borrowing = self.compute_threads > self.own_threads   # shorter prompt steps
        if self._native:
            ops.set_native_threads(self.compute_threads)

    # ---- one step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules, runs and post-processes one batch.  A step that raises
        fails the requests it scheduled (outputs with ``error``) and returns;
        EngineDeadError when the engine cannot go on."""
        try:
            outputs = self._step_native_threads() if self._native else self._step()
        except Exception as exc:  # noqa: BLE001 - model, scheduler, anything: contained to this step
            return self._recover(exc)
        self._consecutive_failed_steps = 0
        return outputs

    def _step_native_threads(self) -> list[RequestOutput]:
        if self.threads_source is not None:
            wanted = self.threads_source()
            if wanted != self.compute_threads:
                self.set_compute_threads(wanted)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._step()
        finally:
            torch.set_num_threads(threads)

    def _step(self) -> list[RequestOutput]:
        self._in_flight, self._step_outputs = None, []
        outputs = self._step_outputs  # kept on self: a step that raises still hands these out
        self.expire_stale()
        out = self.scheduler.schedule()
        self._in_flight = [s.request for s in out.scheduled]
        if out.is_empty:
            if self.tiers is not None:
                self.tiers.wait(_TIER_LOAD_WAIT_S)  # only tier loads are pending: nothing to run meanwhile
            return []
        self.num_steps += 1
        started = time.perf_counter()
        sampled = self.runner.execute(out)
        self.scheduler.step_cost.observe(out.num_tokens, time.perf_counter() - started,
                                         sum(e.num_new_tokens for e in out.prefills))
        if sampled.failed:
            outputs += [self._fail(s.request, sampled.failed[s.request.request_id])
                        for s in out.scheduled if s.request.request_id in sampled.failed]
            out = _without(out, sampled.failed)  # their blocks of this step never reach the prefix cache
        got = self.scheduler.update(out, sampled.token_ids, sampled.verified)
        for req in got:
            outputs.append(self._postprocess_or_fail(req, len(sampled.verified.get(req.request_id, ())) or 1))
        if sampled.logprobs or sampled.prompt_logprobs or sampled.verified_logprobs:  # only when a row asked
            _attach_logprobs(outputs, sampled)
        self._in_flight = None
        return outputs

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """After a step raised: fails the requests it scheduled (if scheduling
        itself raised, those it was working on), then checks that every KV
        block is still accounted for."""
        self.num_failed_steps += 1
        self._consecutive_failed_steps += 1
        log.error("engine step failed; failing its requests: error=%r", exc, exc_info=exc)
        s = self.scheduler
        suspects = self._in_flight if self._in_flight is not None else list(s.running) + list(s.waiting)[:1]
        self._in_flight = None
        why = (f"the engine step running this request failed ({type(exc).__name__}: {exc}); "
               "other requests are unaffected: retry")
        try:
            outputs = self._step_outputs + [self._fail(r, why) for r in suspects
                                            if self.requests.get(r.request_id) is r]
            self.check_integrity()
        except Exception as broken:  # noqa: BLE001 - whatever it is, the engine cannot be trusted now
            raise EngineDeadError(f"the KV bookkeeping is inconsistent after a failed step ({broken!r}; the step "
                                  f"failed with {exc!r}): restart the replica") from exc
        if self._consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineDeadError(f"{self._consecutive_failed_steps} engine steps in a row failed, the last with "
                                  f"{exc!r}: the fault is not in one request; restart the replica") from exc
        return outputs

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """Ends one request with an error: its blocks go back, the engine forgets it."""
        if not req.is_finished:
            self.scheduler.finish(req, FinishReason.ABORT)
        self._forget(req.request_id)
        self.num_failed_requests += 1
        log.warning("request failed: request_id=%s error=%s", req.request_id, why)
        return RequestOutput(req.request_id, finished=True, finish_reason=FinishReason.ABORT,
                             num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
                             num_output_tokens=len(req.output_token_ids), first_scheduled_s=req.first_scheduled_s,
                             error=why)

    def _postprocess_or_fail(self, req: Request, num_new: int = 1) -> RequestOutput:
        try:
            return self._postprocess(req, num_new)
        except Exception as exc:  # noqa: BLE001 - one request's detokenizer or lease: fail it alone
            log.error("post-processing failed: request_id=%s error=%r", req.request_id, exc, exc_info=exc)
            return self._fail(req, f"the engine failed to post-process this request ({type(exc).__name__}: "
                                   f"{exc}); other requests are unaffected: retry")

    def _stop_reason(self, req: Request, token: int, detok: IncrementalDetokenizer) -> FinishReason | None:
        p = req.params
        if (not p.ignore_eos and token in self.tokenizer.eos_token_ids) or token in p.stop_token_ids:
            return FinishReason.STOP
        if detok.stopped:
            return FinishReason.STOP
        if p.guided is not None and self.runner.sampler.grammar.is_done(req.request_id):
            return FinishReason.STOP  # the grammar is complete: the output parses
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _postprocess(self, req: Request, num_new: int = 1) -> RequestOutput:
        """The step's ``num_new`` tokens (more than one after an accepted
        draft), each checked for a stop in turn: tokens after the first stop
        are dropped, as if never generated."""
        detok = self._detok[req.request_id]
        new = req.output_token_ids[-num_new:]
        del req.output_token_ids[-num_new:]
        kept: list[int] = []
        delta, reason = "", None
        for token in new:
            req.output_token_ids.append(token)
            kept.append(token)
            is_eos = token in self.tokenizer.eos_token_ids and not req.params.ignore_eos
            delta += "" if is_eos else detok.add(token)
            reason = self._stop_reason(req, token, detok)
            if reason is not None:
                break
        out = RequestOutput(req.request_id, kept, delta, num_prompt_tokens=req.num_prompt_tokens,
                            num_cached_tokens=req.num_cached_tokens, num_output_tokens=len(req.output_token_ids),
                            first_scheduled_s=req.first_scheduled_s)
        if self.speculator is not None:
            out.num_draft_tokens, out.num_accepted_draft_tokens = self.speculator.totals(req.request_id)
        if reason is None and req.prefill_only:
            lease = self.leases.pin(req.request_id, list(req.block_ids))  # may raise: the request still owns them
            blocks = self.scheduler.finish(req, FinishReason.PREFILLED, keep_blocks=True)
            out.prefill = PrefillResult(token, tuple(blocks), req.num_prompt_tokens, req.num_cached_tokens,
                                        lease.deadline_unix)
            reason = FinishReason.PREFILLED
        elif reason is not None:
            self._finish(req, reason)
            out.text_delta += detok.finish()
        if reason is not None:
            out.finished, out.finish_reason = True, reason
            self._forget(req.request_id)
        return out

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        self.runner.sampler.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    # ---- views ---------------------------------------------------------------
    def stats(self) -> EngineStats:
        s, spec = self.scheduler, self.speculator
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), num_awaiting_kv=len(self.awaiting_kv),
            kv_blocks_total=self.kv.num_total_blocks, kv_blocks_free=self.kv.num_free_blocks,
            kv_blocks_cached=self.kv.num_cached_blocks, leased_blocks=self.leases.num_pinned_blocks,
            prompt_tokens_computed=s.num_prompt_tokens_computed, prompt_tokens_cached=s.num_prompt_tokens_cached,
            num_preemptions=s.num_preemptions, num_steps=self.num_steps,
            num_failed_requests=self.num_failed_requests, num_failed_steps=self.num_failed_steps,
            num_expired_reservations=self.num_expired_reservations, num_refused_reads=self.leases.num_refused_reads,
            quarantined_blocks=sum(len(b) for b in self._quarantine.values()),
            tenant_kv_blocks=largest_charges(self.kv.charged),
            spec_proposed_tokens=spec.num_proposed_tokens if spec else 0,
            spec_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_verify_steps=spec.num_verify_steps if spec else 0,
            spec_emitted_tokens=spec.num_emitted_tokens if spec else 0,
            kv_tiers=self.tiers.snapshot() if self.tiers is not None else None)

    def close(self) -> None:
        """Stops the tier workers and the grammar compile processes (the engine is not used after)."""
        if self.tiers is not None:
            self.tiers.close()
        self.grammars.close()

    def check_integrity(self) -> None:
        """Asserts the pool is consistent and every block reference has an
        owner: a request (running, waiting or reserved), the lease table or a quarantine."""
        self.kv.check_integrity()
        s = self.scheduler
        reqs = list(s.running) + list(s.waiting) + list(s.awaiting_kv.values()) + list(s.loading.values())
        owners: Counter[int] = Counter(self.leases.held_block_ids())
        if self.tiers is not None:
            self.tiers.check_integrity()
            owners.update(self.tiers.held_block_ids())  # blocks a tier load fills, and the hit it extends
        owners.update(self.peer_imports.held_block_ids())  # blocks a peer pull fills
        for held in self._quarantine.values():
            owners.update(held)
        for req in reqs:
            req.check_invariants(self.kv_spec.block_size)
            owners.update(req.block_ids)
        wrong = [b for b in range(self.kv.num_total_blocks) if self.kv.ref_count(b) != owners[b]]
        if wrong:
            b = wrong[0]
            raise AssertionError(f"{len(wrong)} blocks have a ref count their owners do not explain, e.g. block "
                                 f"{b}: ref {self.kv.ref_count(b)}, held {owners[b]} times")

    # ---- offline ---------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 ) -> list[RequestOutput]:
        """Runs prompts to completion; one merged output per prompt, in order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [f"generate-{self.num_steps}-{i}" for i in range(len(prompts))]
        merged = {rid: RequestOutput(rid) for rid in ids}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            for o in self.step():
                m = merged[o.request_id]
                m.new_token_ids += o.new_token_ids
                m.text_delta += o.text_delta
                m.finished, m.finish_reason, m.error = o.finished, o.finish_reason, o.error
                m.num_prompt_tokens, m.num_cached_tokens = o.num_prompt_tokens, o.num_cached_tokens
                m.num_output_tokens = o.num_output_tokens
                m.num_draft_tokens, m.num_accepted_draft_tokens = o.num_draft_tokens, o.num_accepted_draft_tokens
                if o.logprobs is not None:
                    m.logprobs = (m.logprobs or []) + o.logprobs
                m.prompt_logprobs = m.prompt_logprobs if o.prompt_logprobs is None else o.prompt_logprobs
        return [merged[rid] for rid in ids]


def _attach_logprobs(outputs: list[RequestOutput], sampled: SampleResult) -> None:
    """Hands each output its sampled token's logprobs and, with its first
    token, its prompt's."""
    for o in outputs:
        if o.error is None and o.new_token_ids:
            if o.request_id in sampled.logprobs:
                o.logprobs = [sampled.logprobs[o.request_id]]
            elif o.request_id in sampled.verified_logprobs:  # a stop may have dropped the last few
                o.logprobs = sampled.verified_logprobs[o.request_id][:len(o.new_token_ids)]
            o.prompt_logprobs = sampled.prompt_logprobs.get(o.request_id)


def _without(out: SchedulerOutput, failed: dict[str, str]) -> SchedulerOutput:
    """The step's schedule less the requests that already failed."""
    def keep(entries):
        return [s for s in entries if s.request.request_id not in failed]
    return SchedulerOutput(keep(out.decodes), keep(out.prefills), out.preempted)
