"""Iteration-level continuous batching with chunked prefill.

Each ``schedule()`` spends a token budget:

1. running requests, oldest first: a decode token, or the next prefill chunk
   (at most ``prefill_chunk_size``).  If the pool cannot hold a request's new
   tokens, the *newest* running request is preempted by recompute (blocks
   freed, full ones stay in the prefix cache, back to the waiting queue head)
   until it can -- or the request itself was the newest.
2. waiting requests, first come first served, while seats, budget and the
   KV watermarks allow; leading blocks found in the prefix cache are taken
   by reference and skipped by compute.  Nothing is admitted in a step that
   preempted.

With a speculator (spec_decode.py), a decoding request may also feed a
draft of k tokens after its last one (k+1 tokens, one query); the draft's
blocks come only from free ones -- a draft never preempts anyone -- and
``update()`` keeps the accepted part and frees the blocks past it.

Two more ways in, both admitted here (the scheduler is the only writer of
its queues): a resumed request enters ``waiting`` with the output another
replica generated (``add(req, prior_output_token_ids)``, output_history.py),
and a request whose prompt K/V is computed elsewhere is reserved into
``awaiting_kv`` (``reserve_external``) and joins ``running`` once the K/V has
landed (``commit_external``); a resumed request can come that way too, its
prior output's K/V computed with the prompt's by a prefill replica::

    add ------------------------> waiting --admit--> running --finish--> (gone)
    reserve_external --> awaiting_kv --commit_external--^

Both queues are ordered by the request's ``params.priority`` (vLLM's: lower
first), then by its tenant's fair share (fair_queue.py: start-time fair
queueing on the tokens each brings; arrival order when there is one tenant):
the more urgent are admitted and scheduled first, a tenant's flood queues
behind the others' requests of its priority, not in front of them, and
preemption takes the least urgent (the last of them), never a more urgent
request for a less urgent one.

The scheduler never runs the model; ``update()`` applies the step's result.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import takewhile

from pdcluster.prefix_store.hashing import hash_prompt_blocks
from pdcluster.services.engine.config import SchedulerConfig
from pdcluster.services.engine.fair_queue import FairClock
from pdcluster.services.engine.kv_cache import KVCache, PrefixMatch
from pdcluster.services.engine.kv_tiers import HOST, KVTiers, LandedLoad
from pdcluster.services.engine.request import FinishReason, Request, RequestStatus
from pdcluster.services.sampling_params import DEFAULT_TENANT
from pdcluster.services.engine.spec_decode import Speculator
from pdcluster.services.engine.step_limits import StepCost, Stream, step_limits, widest_step


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # fed this step: prompt chunk, or last token (+ the draft)
    spec_token_ids: list[int] = field(default_factory=list)  # the draft, fed after the last token

    @property
    def samples(self) -> bool:
        """Whether this step's last token yields a new token (prompt done)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == r.num_tokens


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledRequest] = field(default_factory=list)   # one token each
    prefills: list[ScheduledRequest] = field(default_factory=list)  # chunks
    preempted: list[Request] = field(default_factory=list)

    def add(self, entry: ScheduledRequest) -> None:
        # A one-token step at an output position has the decode shape: one
        # query over paged KV.  A prompt position always goes through the
        # prefill kernel, even alone (a prompt's last token after a cache
        # hit), so its K/V never depends on how much of the prompt another
        # replica had cached (identity across a failover hop, runner.py).
        r = entry.request
        one_output_token = entry.num_new_tokens == 1 and r.num_computed_tokens >= r.num_prompt_tokens
        (self.decodes if one_output_token else self.prefills).append(entry)

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCache, hash_seed: int,
                 speculator: Speculator | None = None, tiers: KVTiers | None = None):
        self.config = config
        self.tiers = tiers
        self.speculator = speculator
        self.kv = kv
        self.block_size = kv.spec.block_size
        self.hash_seed = hash_seed
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.awaiting_kv: dict[str, Request] = {}  # reserved blocks, prompt K/V coming from outside
        self.loading: dict[str, Request] = {}  # parked while a tier loads their next blocks (kv_tiers.py)
        self._tier_loaded: set[str] = set()  # parked once since their last admission: never twice in a row
        self._admission_paused = False
        # Set by the engine with its thread count: computing on borrowed cores (core_lending.py),
        # so the step takes a short prompt share (engine/step_limits.py).
        self.borrowing = False
        self.step_cost = StepCost()  # fed by the engine with each step's time: how wide a step may go
        self.fair = FairClock(dict(config.tenant_weights))
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_prompt_tokens_cached = 0

    # ---- hashing -----------------------------------------------------
    def update_hashes(self, req: Request) -> list[int]:
        """Extends ``req.block_hashes`` to every full block of its tokens."""
        n_full = req.num_tokens // self.block_size
        if len(req.block_hashes) < n_full:
            start = len(req.block_hashes)
            parent = req.block_hashes[-1] if start else None
            tokens = req.all_token_ids[: n_full * self.block_size]
            req.block_hashes.extend(hash_prompt_blocks(self.hash_seed, tokens, self.block_size, start, parent))
        return req.block_hashes

    def commit_computed_blocks(self, req: Request) -> None:
        """Puts the request's newly full, computed blocks into the prefix cache."""
        n_full = req.num_computed_tokens // self.block_size
        blocks = req.block_ids[:n_full]
        if not self.kv.enable_prefix_caching or all(self.kv.is_cached(b) for b in blocks):
            return  # nothing newly full: spare copying the tokens every step
        hashes = self.update_hashes(req)[:n_full]
        self.kv.commit(blocks, hashes, req.all_token_ids)

    # ---- queue -------------------------------------------------------
    def add(self, req: Request, prior_output_token_ids: Sequence[int] = ()) -> None:
        """Queues ``req``.  A resumed request brings the output another replica
        generated: it counts as output, and admission recomputes its K/V as it
        does a preempted request's (output_history.py)."""
        req.output_token_ids.extend(prior_output_token_ids)
        req.status = RequestStatus.WAITING
        req.fair_tag = self.fair.tag(req.params.tenant, req.num_tokens)
        _insert_by_priority(self.waiting, req)

    def reserve_external(self, req: Request) -> int | None:
        """Admits ``req`` to wait for its K/V from outside: blocks for all its
        tokens -- the prompt, and a resumed request's output so far (another
        replica generated it; the prefill replica computed its K/V with the
        prompt's) -- the leading ones found in the prefix cache taken by
        reference.  Returns how many blocks the cache held, or None if the
        pool cannot hold it now::

            [ prompt ........ | prior output ...... ]   req.num_tokens: K/V written from outside
            [ cached | reserved ................... ]   then commit_external: + first token, decode on

        With tiers, the leading blocks past the pool's match that the host tier
        holds are copied back first and count as cached (the sender skips them);
        blocks on disk are pulled like the rest: a read would hold up this call.
        """
        hashes = self.update_hashes(req)
        if self.tiers is not None:  # the blocks its host tier keeps need no pull (disk ones would wait a read)
            self.stage_tier_blocks(req.request_id, hashes, req.all_token_ids, req.params.tenant, host_only=True)
        match = self.kv.match_prefix(hashes, req.all_token_ids)
        need = _cdiv(req.num_tokens, self.block_size) - match.num_blocks
        if need > self.kv.num_free_blocks - match.num_evictable:
            return None
        self.kv.acquire(match.block_ids)
        req.block_ids = list(match.block_ids) + self.kv.allocate(need, req.params.tenant)
        req.num_cached_tokens = match.num_blocks * self.block_size
        req.fair_tag = self.fair.tag(req.params.tenant, req.num_tokens)
        self.fair.taken(req.fair_tag)
        req.status = RequestStatus.WAITING_FOR_KV
        self.awaiting_kv[req.request_id] = req
        return match.num_blocks

    def commit_external(self, request_id: str, first_token_id: int) -> Request | None:
        """The reserved blocks of ``request_id`` hold its K/V now (prompt, and
        prior output if resumed): its full blocks enter the prefix cache and it
        runs, decoding from ``first_token_id``.  None if nothing is reserved
        under that id."""
        req = self.awaiting_kv.pop(request_id, None)
        if req is None:
            return None
        req.num_computed_tokens = req.num_tokens
        self.commit_computed_blocks(req)
        req.output_token_ids.append(first_token_id)
        req.first_token_s = time.monotonic()  # its TPOT's clock (step_limits.widest_step) starts here
        req.status = RequestStatus.RUNNING
        _insert_by_priority(self.running, req)
        return req

    def _dequeue(self, req: Request) -> None:
        self._tier_loaded.discard(req.request_id)
        if self.loading.get(req.request_id) is req:
            del self.loading[req.request_id]
        elif self.awaiting_kv.get(req.request_id) is req:
            del self.awaiting_kv[req.request_id]
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def free_blocks(self, req: Request) -> None:
        if req.block_ids:
            self.kv.free(req.block_ids)
        req.block_ids = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    # ---- one step ----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.tiers is not None:
            self.land_tier_loads()
        out = SchedulerOutput()
        limits = step_limits(self.config, self.borrowing, self._lone_prompt(), self.step_cost.seconds_per_token,
                             self._widest_step())
        budget, prompt_left, chunk = limits.tokens, limits.prompt_tokens, limits.chunk
        deferred: list[Request] = []  # long prefills: they take what the rest of the step leaves
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.num_computed_tokens < req.num_prompt_tokens:
                if self._is_long(req):
                    deferred.append(req)
                    i += 1
                    continue
                num_new = min(num_new, chunk, prompt_left)
                if num_new <= 0:
                    i += 1
                    continue
                prompt_left -= num_new
            if not self._grow(req, num_new, out):
                break  # req itself was preempted
            entry = ScheduledRequest(req, num_new)
            if self.speculator is not None and num_new == req.num_tokens - req.num_computed_tokens == 1:
                self._draft(entry, budget - 1)
            out.add(entry)
            budget -= entry.num_new_tokens
            i += 1
        if not out.preempted:
            taken = self._admit(out, min(budget, prompt_left), chunk,
                                long_slots=self.config.max_long_prefills - len(deferred))
            budget, prompt_left = budget - taken, prompt_left - taken
        self._schedule_long(out, deferred, min(budget, prompt_left), chunk)
        now = time.monotonic()
        for s in out.scheduled:
            if s.request.first_scheduled_s is None:  # queue time ends at its first step
                s.request.first_scheduled_s = now
        return out

    def _lone_prompt(self) -> bool:
        """One request on the replica, and it has prompt left to compute (engine/step_limits.py)."""
        if len(self.running) + len(self.waiting) + len(self.loading) + len(self.awaiting_kv) != 1:
            return False
        req = self.running[0] if self.running else self.waiting[0] if self.waiting else None
        return req is not None and req.num_computed_tokens < req.num_prompt_tokens

    def _widest_step(self) -> float | None:
        """The most prompt tokens the next step may take with every stream here still able to end
        within ``wide_step_tpot_s`` (engine/step_limits.py); None with the rule off or untimed."""
        cost = self.step_cost
        if self.config.wide_step_tpot_s <= 0 or cost.decode_step_s is None or cost.seconds_per_token is None:
            return None
        now = time.monotonic()
        streams, queued = [], 0
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                queued += r.num_prompt_tokens - r.num_computed_tokens
            elif r.first_token_s is not None and r.output_token_ids:
                # a resumed stream's tokens from another replica count as taking no time here
                streams.append(Stream(now - r.first_token_s, len(r.output_token_ids), r.params.max_tokens))
        queued += sum(r.num_tokens for r in self.waiting)
        return widest_step(streams, self.config.wide_step_tpot_s, cost.decode_step_s, cost.seconds_per_token, queued)

    def _is_long(self, req: Request, done: int | None = None) -> bool:
        """More than ``long_prefill_tokens`` of its prompt left to compute past ``done`` tokens
        (default: those computed); never with the rule off."""
        n = self.config.long_prefill_tokens
        return n > 0 and req.num_tokens - (req.num_computed_tokens if done is None else done) > n

    def _schedule_long(self, out: SchedulerOutput, deferred: list[Request], budget: int, chunk: int) -> None:
        """The long prefills that yielded to the rest of the step take what it left, oldest first, at
        most ``max_long_prefills`` of them.  Their blocks come from free ones only: the requests a
        preemption would take may already be in this step.  Only a step with nothing else in it
        preempts for them, as every step did before (else a long prompt alone could wait forever)."""
        slots = self.config.max_long_prefills
        for req in deferred:
            if slots <= 0 or budget <= 0:
                return
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(req.num_tokens - req.num_computed_tokens, budget, chunk)
            if out.is_empty:
                if not self._grow(req, num_new, out):
                    return
            else:
                have = len(req.block_ids) + self.kv.num_free_blocks
                num_new = min(num_new, have * self.block_size - req.num_computed_tokens)
                need = _cdiv(req.num_computed_tokens + num_new, self.block_size) - len(req.block_ids)
                if num_new <= 0:
                    return
                if need > 0:
                    got = self.kv.allocate(need, req.params.tenant)
                    if got is None:
                        return
                    req.block_ids.extend(got)
            out.add(ScheduledRequest(req, num_new))
            budget -= num_new
            slots -= 1

    def _grow(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocates blocks for ``num_new`` more tokens, preempting the newest
        running requests as needed.  False if ``req`` itself got preempted."""
        need = _cdiv(req.num_computed_tokens + num_new, self.block_size) - len(req.block_ids)
        while need > 0 and not self.kv.can_allocate(need):
            if self.tiers is not None and self._release_holds():
                continue
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        if need > 0:
            req.block_ids.extend(self.kv.allocate(need, req.params.tenant))
        return True

    def _draft(self, entry: ScheduledRequest, budget: int) -> None:
        """Adds the speculator's draft to a decode step if free blocks hold it."""
        req = entry.request
        draft = self.speculator.propose(req, budget)
        if not draft:
            return
        need = _cdiv(req.num_computed_tokens + 1 + len(draft), self.block_size) - len(req.block_ids)
        if need > 0:
            # Leave a block for each running request: a draft must not cause a preemption.
            if not self.kv.can_allocate(need + len(self.running)):
                return
            req.block_ids.extend(self.kv.allocate(need, req.params.tenant))
        entry.spec_token_ids = draft
        entry.num_new_tokens += len(draft)

    def _preempt(self, req: Request) -> None:
        self.free_blocks(req)
        if self.speculator is not None:
            self.speculator.preempted(req.request_id)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        _insert_by_priority(self.waiting, req, first_of_its_priority=True)  # it ran before the others
        self.num_preemptions += 1
        self._admission_paused = True

    def _admission_open(self) -> bool:
        usage = self.kv.usage
        if self._admission_paused and usage < self.config.kv_watermark_low:
            self._admission_paused = False
        return not self._admission_paused

    def _admit(self, out: SchedulerOutput, budget: int, chunk: int, long_slots: int = 1 << 30) -> int:
        """Admits waiting requests in queue order within ``budget`` prompt tokens, at most ``chunk``
        of a prompt each; returns the tokens they take.  A long one (``_is_long``) waits while
        ``long_slots`` long prefills already run, and the shorter ones behind it go ahead."""
        cfg, bs = self.config, self.block_size
        start, j = budget, 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            if self.running and not self._admission_open():
                break
            req = self.waiting[j]
            # Keep at least one token to compute: its logits give the next token.
            hashes = self.update_hashes(req)[: (req.num_tokens - 1) // bs]
            if req.draw.prompt_logprobs is not None and not req.output_token_ids:
                hashes = []  # prompt logprobs need every position's logits: a cached block has none
            match = self.kv.match_prefix(hashes, req.all_token_ids)
            if self.tiers is not None and self._park(j, req, hashes, match):
                continue
            cached = match.num_blocks * bs
            long = self._is_long(req, cached)
            if long and long_slots <= 0:
                j += 1
                continue
            num_new = min(req.num_tokens - cached, budget)
            if cached + num_new < req.num_prompt_tokens:
                num_new = min(num_new, chunk)
            need = _cdiv(cached + num_new, bs) - match.num_blocks
            free_after = self.kv.num_free_blocks - match.num_evictable - need
            if free_after < 0:
                break
            if self.running and 1 - free_after / self.kv.num_total_blocks > cfg.kv_watermark_high:
                self._admission_paused = True
                break
            del self.waiting[j]
            long_slots -= long
            self.fair.taken(req.fair_tag)
            if self.tiers is not None:
                self.tiers.count_admission(req.request_id in self._tier_loaded)
            self._tier_loaded.discard(req.request_id)
            self.kv.acquire(match.block_ids)
            self.free_blocks(req)  # what a tier load held for it: the match has them now
            req.block_ids = list(match.block_ids) + self.kv.allocate(need, req.params.tenant)
            req.num_computed_tokens = req.num_cached_tokens = cached
            req.status = RequestStatus.RUNNING
            _insert_by_priority(self.running, req)
            self.num_prompt_tokens_cached += cached
            out.add(ScheduledRequest(req, num_new))
            budget -= num_new
        return start - budget

    # ---- tiers under the pool (kv_tiers.py) ----------------------------
    def _park(self, j: int, req: Request, hashes: list[int], match: PrefixMatch) -> bool:
        """Loads the next blocks of ``req`` (``waiting[j]``) from a tier, if one
        holds them and the pool has room for them below the high watermark;
        True when it did (then admission looks at the queue again).  Host
        blocks land at once; disk blocks are filled off this thread while the
        request waits in ``loading``.  The load holds the device hit too, and
        once landed the request holds both in ``waiting`` (so nothing evicts
        them before its admission, ``_admit``; ``_grow`` takes them back if a
        running request needs the room)::

            prompt blocks  [ device hit | tier hit ......... | rest ]
                             acquired     fresh, loading      computed once admitted
        """
        if req.request_id in self._tier_loaded:
            return False
        num_loading, landed = self._start_tier_load(req.request_id, hashes, req.all_token_ids, match,
                                                    req.params.tenant)
        if not num_loading:
            return False
        self._tier_loaded.add(req.request_id)
        if landed is not None:
            self._hold(req, landed)
        else:
            del self.waiting[j]
            self.loading[req.request_id] = req
        return True

    def stage_tier_blocks(self, key: str, hashes: Sequence[int], token_ids: Sequence[int],
                          tenant: str = DEFAULT_TENANT, host_only: bool = False) -> int:
        """Brings a prompt's blocks past the pool's match back from the tiers for no
        request of this engine (a peer's lease takes them from the prefix cache,
        peer_import.lend_blocks; a reservation, ``reserve_external``): host blocks
        land now, disk blocks once the loader thread has read them (``land_tier_loads``:
        a load no request owns gives its blocks back, cached), charged to ``tenant``
        (a reservation's, so its KV guarantee keeps them); ``host_only``: the leading
        run the host tier holds, nothing read from disk.  Returns how many blocks are
        still loading under ``key``."""
        num_loading, landed = self._start_tier_load(key, hashes, token_ids, self.kv.match_prefix(hashes, token_ids),
                                                    tenant, host_only)
        if landed is None:
            return num_loading
        self.kv.free(landed.keep + landed.drop)
        return 0

    def _start_tier_load(self, key: str, hashes: Sequence[int], token_ids: Sequence[int], match: PrefixMatch,
                         tenant: str = DEFAULT_TENANT, host_only: bool = False) -> tuple[int, LandedLoad | None]:
        """Loads the tiers' blocks past ``match`` into fresh pool blocks, as many as the pool has
        room for below the high watermark (``host_only``: up to the first on disk); the load holds
        ``match``'s blocks too.  (blocks loaded, the landed load when they were all in host memory,
        else None: the loader thread reads them)."""
        room = self.kv.num_free_blocks - match.num_evictable
        room -= int((1 - self.config.kv_watermark_high) * self.kv.num_total_blocks)
        sources = self.tiers.lookup(hashes, token_ids, match.num_blocks)[:max(0, room)]
        if host_only:
            sources = list(takewhile(lambda src: src.tier == HOST, sources))
        if not sources:
            return 0, None
        self.kv.acquire(match.block_ids)
        fresh = self.kv.allocate(len(sources), tenant)  # room counted above: never None
        return len(sources), self.tiers.start_load(key, list(match.block_ids) + fresh, fresh, hashes, token_ids,
                                                   match.num_blocks, sources)

    def land_tier_loads(self) -> None:
        """Requests whose loads landed go back to the head of the queue, holding their blocks."""
        for landed in self.tiers.poll():
            req = self.loading.pop(landed.request_id, None)
            if req is None:  # aborted while it loaded
                self.kv.free(landed.keep + landed.drop)
                continue
            self._hold(req, landed)
            _insert_by_priority(self.waiting, req, first_of_its_priority=True)

    def _hold(self, req: Request, landed: LandedLoad) -> None:
        self.kv.free(landed.drop)
        req.block_ids = landed.keep

    def _release_holds(self) -> bool:
        """Gives back the blocks one waiting request holds from a tier load (the
        newest such); they stay cached.  False when no waiting request holds any."""
        for req in reversed(self.waiting):
            if req.block_ids:
                self.free_blocks(req)
                return True
        return False

    # ---- after the forward ---------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               verified: dict[str, list[int]] | None = None) -> list[Request]:
        """Advances counters, appends sampled tokens, caches full blocks.
        ``verified``: the tokens each drafted request emitted (spec_decode.py).
        Returns requests that got a new token this step."""
        got_token = []
        for s in out.scheduled:
            req = s.request
            if s.spec_token_ids:
                if verified and req.request_id in verified:
                    self._keep_verified(req, s, verified[req.request_id])
                    got_token.append(req)
                continue
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(s.num_new_tokens, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += s.num_new_tokens
            self.commit_computed_blocks(req)
            if req.request_id in sampled:
                if req.first_token_s is None:
                    req.first_token_s = time.monotonic()
                req.output_token_ids.append(sampled[req.request_id])
                got_token.append(req)
        return got_token

    def _keep_verified(self, req: Request, s: ScheduledRequest, emitted: list[int]) -> None:
        """The drafted step's outcome: the last token and the accepted drafts
        now have K/V; the rejected drafts' slots are dropped, and blocks that
        hold nothing else go back::

            blocks   [ .... | t d1 d2 d3 | d4 . . . ]     k = 4, 2 accepted (d1 d2), then y2 != d3
            computed [ .... | t d1 d2 ]                    d3, d4 dropped; the last block freed
            tokens   [ .... | t d1 d2 y2 ]                 y2's K/V comes next step
        """
        accepted = emitted[:-1]
        assert accepted == s.spec_token_ids[:len(accepted)], (accepted, s.spec_token_ids)
        req.output_token_ids.extend(accepted)
        req.num_computed_tokens += 1 + len(accepted)
        keep = _cdiv(req.num_computed_tokens, self.block_size)
        if len(req.block_ids) > keep:
            self.kv.free(req.block_ids[keep:])
            del req.block_ids[keep:]
        self.commit_computed_blocks(req)
        req.output_token_ids.append(emitted[-1])
        self.speculator.record(req.request_id, len(s.spec_token_ids), len(accepted))

    def finish(self, req: Request, reason: FinishReason, keep_blocks: bool = False) -> list[int]:
        """Ends a request; frees its blocks unless ``keep_blocks`` (then the
        caller owns them, e.g. under a lease).  Returns the block ids."""
        self._dequeue(req)
        blocks = req.block_ids
        if keep_blocks:
            req.block_ids = []
        else:
            self.free_blocks(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        return blocks


def _order(req: Request) -> tuple[int, float]:
    return req.params.priority, req.fair_tag


def _insert_by_priority(queue: deque[Request] | list[Request], req: Request,
                        first_of_its_priority: bool = False) -> None:
    """Keeps ``queue`` ordered by ``params.priority`` (lower first), then fair tag (arrival
    order for one tenant): ``req`` goes after the others of its (priority, tag) or, preempted,
    before every other of its priority.  With one priority and one tenant, as by default,
    this is append (or appendleft)."""
    p, key = req.params.priority, _order(req)
    n = len(queue)
    if not first_of_its_priority:
        if not n or _order(queue[-1]) <= key:
            queue.append(req)
            return
        i = n
        while i > 0 and _order(queue[i - 1]) > key:
            i -= 1
    else:
        i = 0
        while i < n and queue[i].params.priority < p:
            i += 1
    queue.insert(i, req)
