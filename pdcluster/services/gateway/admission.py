"""Admission at the gateway: which place prefills a request (placement.py's
rule), and a 429 only where that rule predicts the SLO would break.

The gateway sees every request of the cluster (one gateway replica), so its
own counters are exact and current, unlike stats polled from the replicas:

    per place (prefill pool, decode pool)   prompt tokens and requests admitted, no first token yet,
                                            per (priority, tenant): a request waits behind its fair
                                            share of the others' (fair_share.py)
    decode_streams                          requests admitted and not finished (each holds a decode seat),
                                            per tenant: the last seats go to tenants below their share
    decode busy                             decode-side prefill seconds placed in the last window
    calibration                             (modelled, measured) TTFT of each place's recent first tokens

The speed model (pdcluster/planning/speed.py) starts from the configured
profile (autoscaling.speed, what `pdcluster plan --profile` measures) and is
calibrated online from the measured TTFTs (pdcluster/planning/calibration.py).
A first token is compared with the model of the work its place actually
served meanwhile: the prompt tokens answered there from its admission to
COBATCH_S after its first token, its own included, each prompt counted by the
tokens its replica computed (a prefix-cache hit is no work: a repeated 1,024-token
prompt answered in 0.18 s, taken as 1,024 computed tokens, pulled the line's
slope to its floor, and a burst of fresh prompts right after set a 2 s tail
margin that refused the next seven on an idle replica).  Not the queue it was
admitted behind: an engine step prefills a burst's prompts together, so the
first of a burst waits for the later ones of its step, and a later arrival
can overtake an earlier one; against the queue model those first tokens
look seconds late, and their residuals set a tail margin that refused
servable requests for minutes (2 s of margin after one burst of 16).
Nothing is refused on a prediction before MIN_SAMPLES first tokens were
measured.  A first token from a replica that had not yet answered one when
its request arrived is no sample (counted in ``samples_left_out``): that
request waited for a replica to start -- the cluster's, a respawn's after a
SIGKILL, a scale-up's -- not for the place's queue.  Taken as samples, the
first tokens of a respawned replica's backlog (5 s late) set a 2.8 s tail
margin that refused a servable chat right after the outage.  Nor is a
request refused on the queue of a place with no live replica, or while
prompts admitted during such an outage are still queued there (its
``backlog_tokens``): that queue waits for a replica to start, and no
measurement says how far along it is.  ``place``
decides and counts; the ``Ticket`` it returns gives the counts back."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

from pdcluster.observability import metrics
from pdcluster.planning.calibration import Calibration, RatioCalibration
from pdcluster.planning.speed import StepModel
from pdcluster.services.backend import BackendOverloaded, for_client
from pdcluster.services.config import AutoscaleSpeed
from pdcluster.services.sampling_params import DEFAULT_TENANT
from pdcluster.services.gateway.fair_share import Class, may_take_seat, tokens_ahead
from pdcluster.services.gateway.placement import (DECODE, PREFILL, PlaceLoad, Placement, Rules, Snapshot, Work,
                                                  is_long_prompt, modelled_ttft_s, place)

MIN_SAMPLES = 4  # first tokens measured (any place) before a prediction may refuse
ACTIVE_S = 30.0  # a tenant that sent a request this recently shares the decode seats
MIN_TPOT_TOKENS = 8  # a stream's TPOT calibrates the decode step model from this many tokens on
COBATCH_S = 0.05  # first tokens this close together at one place came out of one engine step
ARRIVALS_S = 5.0  # a place's arrival rate (the prompts expected to join a step) is measured over this
MAX_REPLICAS_SEEN = 256  # replicas whose first answer a place remembers (the oldest are forgotten)

# Until the gateway is built from a config: the config's default speed model.
DEFAULT_RULES = Rules(*AutoscaleSpeed().models())


class PlaceQueue:
    """Prompt tokens admitted to one place and not yet answered with a first token,
    and the calibration of its speed model."""

    def __init__(self, long_prefill_tokens: int = 0):
        self.long_prefill_tokens = long_prefill_tokens  # 0: the place prefills in arrival order
        self.queued_tokens = 0
        self.queued_long_tokens = 0  # of them: prompts over long_prefill_tokens, which yield to shorter ones
        self.queued_square = self.queued_long_square = 0.0  # their squared lengths summed (attention's share)
        self.queued_requests = 0
        self.backlog_tokens = 0  # of them: admitted while the place had no live replica (an outage's)
        self.by_class: dict[Class, int] = {}  # queued prompt tokens per (priority, tenant)
        self.served_tokens = 0  # prompt tokens answered here with a first token, ever
        self.served_long_tokens = 0  # of them: long prompts'
        self.served_square = self.served_long_square = 0.0  # their squared lengths summed
        self.calibration = Calibration()
        self._pending: deque[tuple[float, Ticket, float]] = deque()  # (first token at, ticket, measured TTFT)
        self._arrivals: deque[tuple[float, int]] = deque()  # (admitted at, prompt tokens), the last ARRIVALS_S
        self._arriving_tokens = 0  # their sum
        self._first_answer_at: dict[str, float] = {}  # replica -> when it answered its first first token here
        self.samples_left_out = 0  # first tokens of requests that waited for a replica to start
        # every prompt queued here arrived after it was idle, before the first token of one that waited
        # (the burst's first prompt ran alone on an idle engine: its first token says nothing of the queue)
        self.fresh_burst = False

    @property
    def num_samples(self) -> int:
        """First tokens measured here (calibrated with, or waiting COBATCH_S to be)."""
        return self.calibration.num_samples + len(self._pending)

    def answered(self, ticket: Ticket, measured_s: float, now: float, replica: str = "") -> None:
        """``ticket``'s first token came out of ``replica`` ("": unknown) ``measured_s`` after the
        request arrived.  No sample when ``replica`` had answered none before the request arrived."""
        self.settle(now)
        if not ticket.opened_burst:  # the prompt that opened it ran on an idle engine: says nothing of the queue
            self.fresh_burst = False
        self.served_tokens += ticket.computed
        self.served_square += ticket.computed_square
        if self.is_long(ticket.computed):
            self.served_long_tokens += ticket.computed
            self.served_long_square += ticket.computed_square
        if replica and ticket.arrived_at < self._first_answer(replica, now):
            self.samples_left_out += 1
            return
        self._pending.append((now, ticket, measured_s))

    def _first_answer(self, replica: str, now: float) -> float:
        """When ``replica`` answered its first first token here (now, if this is it)."""
        if replica not in self._first_answer_at:
            if len(self._first_answer_at) >= MAX_REPLICAS_SEEN:
                del self._first_answer_at[min(self._first_answer_at, key=self._first_answer_at.__getitem__)]
            self._first_answer_at[replica] = now
        return self._first_answer_at[replica]

    def is_long(self, prompt_tokens: int) -> bool:
        return is_long_prompt(prompt_tokens, self.long_prefill_tokens)

    def settle(self, now: float) -> None:
        """Calibrates with the first tokens older than COBATCH_S, each against the model of the
        work this place served from its admission until then (its own prompt and any it was
        batched with or overtaken by)."""
        while self._pending and self._pending[0][0] + COBATCH_S < now:
            _, ticket, measured_s = self._pending.popleft()
            self.calibration.observe(ticket.modelled_for(
                self.served_tokens - ticket.served_before, self.served_long_tokens - ticket.served_long_before,
                self.served_square - ticket.served_square_before,
                self.served_long_square - ticket.served_long_square_before), measured_s)

    def load(self, live_replicas: int, now: float, who: Class | None = None, prompt_tokens: int = 0,
             weights: dict[str, float] | None = None) -> PlaceLoad:
        """The place as a request of class ``who`` sees it: the queued work it waits behind, and
        the prompts arriving (which join the engine steps it waits for)."""
        self.settle(now)
        while self._arrivals and self._arrivals[0][0] < now - ARRIVALS_S:
            self._arriving_tokens -= self._arrivals.popleft()[1]
        ahead = self.queued_tokens if who is None else tokens_ahead(self.by_class, who[1], who[0], prompt_tokens,
                                                                   weights or {})
        share = min(ahead / self.queued_tokens, 1.0) if self.queued_tokens > 0 else 0.0  # of the squares: ahead's
        return PlaceLoad(live_replicas, ahead, self.queued_requests if ahead else 0, self.calibration.predict,
                         self.calibration.margin_s, self._arriving_tokens / ARRIVALS_S,
                         min(self.queued_long_tokens, ahead), self.backlog_tokens,
                         max(self.queued_square, 0.0) * share, max(self.queued_long_square, 0.0) * share,
                         self.fresh_burst)

    def admit(self, who: Class, tokens: int, now: float, in_outage: bool = False) -> bool:
        """Queues a prompt here; True when it opens a fresh burst (nothing was queued)."""
        opens = self.queued_requests == 0
        if opens:
            self.fresh_burst = True
        self.add(who, tokens, +1, in_outage)
        self._arrivals.append((now, tokens))
        self._arriving_tokens += tokens
        return opens

    def add(self, who: Class, tokens: int, sign: int, in_outage: bool = False) -> None:
        self.queued_tokens += sign * tokens
        self.backlog_tokens += sign * tokens if in_outage else 0
        self.queued_square += sign * tokens ** 2
        if self.is_long(tokens):
            self.queued_long_tokens += sign * tokens
            self.queued_long_square += sign * tokens ** 2
        self.queued_requests += sign
        left = self.by_class.get(who, 0) + sign * tokens
        if left or sign > 0:
            self.by_class[who] = left
        else:
            self.by_class.pop(who, None)


class Ticket:
    """One admitted request: ``first_token()`` when its first token arrives,
    ``close()`` when it ends (either order; both idempotent).  ``pool`` is
    where its prompt is prefilled: "prefill" or "decode".  ``computed``: the
    prompt tokens its replica computed (all of them until the first token says
    how many were cached)."""

    def __init__(self, admission: Admission, placement: Placement, tokens: int, who: Class = (0, DEFAULT_TENANT),
                 arrived_at: float = 0.0, in_outage: bool = False, opened_burst: bool = False):
        self._admission, self.placement, self.tokens, self.who = admission, placement, tokens, who
        self.in_outage = in_outage  # admitted while its place had no live replica
        self.opened_burst = opened_burst  # it found its place's queue empty (PlaceQueue.fresh_burst)
        self.pool = placement.pool
        # what its place counts queued for it: the prompt less the prefix the index says is cached there
        self.queued = placement.computed_tokens or tokens
        place = admission.places[self.pool]
        self.served_before, self.served_long_before = place.served_tokens, place.served_long_tokens
        self.served_square_before, self.served_long_square_before = place.served_square, place.served_long_square
        self._longs_ahead = place.queued_long_tokens  # long prompts queued there at its admission
        now = time.monotonic()
        self.arrived_at = arrived_at if 0 < arrived_at <= now else now  # the gateway's clock, or now
        self._queued, self._open = True, True
        self._streams_at_start = admission.in_flight + 1  # the decode batch it joins (itself included)
        self._first_s = self._last_s = 0.0
        self._num_tokens = 0
        self.computed = self.queued  # until its first token says what was cached

    @property
    def computed_square(self) -> float:
        """Its attention's share (placement.Work: tokens^2 - cached^2)."""
        return Work.of(self.tokens, self.tokens - self.computed).square

    def first_token(self, num_tokens: int = 1, replica: str = "", cached_tokens: int = 0) -> None:
        """A chunk of ``num_tokens`` came out (the first one: its first token, from ``replica``,
        which found ``cached_tokens`` of the prompt in its prefix cache)."""
        now = time.monotonic()
        if self._queued:
            self._queued = False
            self.computed = Work.of(self.tokens, cached_tokens).tokens
            self._first_s = now
            self._admission._dequeue(self, now - self.arrived_at, replica)
        self._num_tokens += num_tokens
        self._last_s = now

    def modelled_for(self, served_tokens: int, served_long_tokens: int = 0, served_square: float = 0.0,
                     served_long_square: float = 0.0) -> float:
        """The model's TTFT for this prompt at a place that served ``served_tokens`` (its own
        included; ``served_long_tokens`` of them long prompts'; ``served_*square``: their squared
        lengths summed) while it waited, with the replicas and streams of its admission.  A short
        prompt at a place that takes short ones first counts the long prompts queued at its
        admission as served beside it too: their chunks filled its steps, whether or not they
        finished meanwhile (their squares not: the steps it waited for were counted full)."""
        p = self.placement
        others = max(served_tokens - self.computed, 0)
        squares = max(served_square - self.computed_square, 0.0)
        longs = max(served_long_tokens, self._longs_ahead)
        if longs and not self._admission.places[self.pool].is_long(self.computed):
            load = PlaceLoad(p.live_replicas, others - served_long_tokens + longs, queued_long_tokens=longs,
                             queued_square_tokens=max(squares - served_long_square, 0.0))
        else:
            load = PlaceLoad(p.live_replicas, others, queued_square_tokens=squares)
        return modelled_ttft_s(self.computed, load, self._admission.rules, p.beside_streams, joining=False,
                               prompt_square=self.computed_square)

    def close(self) -> None:
        if self._queued:
            self._queued = False
            self._admission._dequeue(self, None)
        if self._open:
            self._open = False
            self._admission._end_stream(self.who[1])
            if self._num_tokens > MIN_TPOT_TOKENS:
                tpot = (self._last_s - self._first_s) / (self._num_tokens - 1)
                self._admission._observe_tpot((self._streams_at_start + self._admission.in_flight + 1) / 2, tpot)


class Admission:
    def __init__(self, ttft_slo_s: float, max_in_flight: int, shed: bool = True, headroom: float = 0.8,
                 rules: Rules | None = None, decode_seats_per_replica: int = 1 << 30,
                 tenant_weights: dict[str, float] | None = None, adopts_measured_prefill: bool = False,
                 adopts_measured_step: bool = False):
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        self.rules = replace(rules or DEFAULT_RULES, ttft_slo_s=ttft_slo_s, headroom=headroom, shed=shed)
        self.ttft_slo_s, self.max_in_flight, self.shed, self.headroom = ttft_slo_s, max_in_flight, shed, headroom
        self.decode_seats_per_replica = decode_seats_per_replica
        self.in_flight = 0
        self.tenant_weights = dict(tenant_weights or {})
        self.streams_of: dict[str, int] = {}  # decode seats each tenant holds
        self.num_seat_shares = 0  # refused one of the last seats: the tenant held its share
        self._last_seen: dict[str, float] = {}  # tenant -> when it last asked (ACTIVE_S)
        self.tpot = RatioCalibration()  # measured TPOT over the step model's, at the streams it ran beside
        self._decode_live = 1
        self.places = {PREFILL: PlaceQueue(), DECODE: PlaceQueue(self.rules.long_prefill_tokens)}
        self._decode_busy: deque[tuple[float, float]] = deque()  # (when placed, seconds of decode time)
        self.num_shed = 0
        self.num_past_prediction = 0  # admitted although predicted late (placement.py: a fresh burst's short prompts)
        self.num_over_capacity = 0
        self.num_admitted = 0
        self.placed = {PREFILL: 0, DECODE: 0}
        self.admitted_prompt_tokens = 0  # whichever pool prefills them: the autoscaler's prompt mean
        # The replicas' start-up prefill time replaces the configured one, once, before any first token
        # calibrated the model (adopt_prefill).
        self._may_adopt_prefill = adopts_measured_prefill
        self._may_adopt_step = adopts_measured_step

    @property
    def may_adopt_prefill(self) -> bool:
        return self._may_adopt_prefill and self.num_measured == 0

    def adopt_prefill(self, per_token_s: float | None, per_token2_s: float | None = None,
                      source: str = "measured at start-up") -> bool:
        """The prefill line from the replicas' own start-up measurement
        (pdcluster/services/pools/startup_profile.py), if no first token was measured yet: the
        calibration's samples compare with the model they were made under.  Once.  With its square
        term (``per_token2_s``) the measured line replaces the configured one whole, per-step
        overhead included (the measured per-token time holds each chunk's step); without it only
        the seconds per token."""
        if not self.may_adopt_prefill or not per_token_s or not 0 < per_token_s < 1:
            return False
        prefill = replace(self.rules.prefill, per_token_s=per_token_s, source=source)
        if per_token2_s is not None and 0 <= per_token2_s < 1e-3:
            prefill = replace(prefill, overhead_s=0.0, per_token2_s=per_token2_s)
        self.rules = replace(self.rules, prefill=prefill)
        self._may_adopt_prefill = False
        return True

    @property
    def may_adopt_step(self) -> bool:
        return self._may_adopt_step and self.num_measured == 0 and self.tpot.num_samples == 0

    def adopt_step(self, line: tuple[float, float] | None, source: str = "measured at start-up") -> bool:
        """The decode step line (base seconds, seconds per sequence) from the replicas' own start-up
        measurement, if no first token or TPOT was measured yet (both calibrate against the model they
        were made under).  Once."""
        if not self.may_adopt_step or not line:
            return False
        base, per_seq = line
        if not (0 < base < 1 and 0 <= per_seq < 1):
            return False
        self.rules = replace(self.rules, step=StepModel(base_s=base, per_seq_s=per_seq, source=source))
        self._may_adopt_step = False
        return True

    @property
    def num_measured(self) -> int:
        return sum(q.num_samples for q in self.places.values())

    def snapshot(self, prefill_live: int | None, decode_live: int | None, now: float, who: Class | None = None,
                 prompt_tokens: int = 0) -> Snapshot:
        """``*_live``: live replicas (None: unknown -- no Redis -- counted as one; prefill 0: no prefill pool);
        ``who``: the class of the request it is for (None: the whole queues)."""
        decode = 1 if decode_live is None else max(decode_live, 0)
        prefill_live = 1 if prefill_live is None else prefill_live
        w = self.tenant_weights
        prefill = self.places[PREFILL].load(prefill_live, now, who, prompt_tokens, w) if prefill_live > 0 else None
        while self._decode_busy and self._decode_busy[0][0] < now - self.rules.window_s:
            self._decode_busy.popleft()
        return Snapshot(prefill=prefill, decode=self.places[DECODE].load(decode, now, who, prompt_tokens, w),
                        decode_streams=self.in_flight, decode_seats=self.decode_seats_per_replica * max(decode, 1),
                        decode_busy_s=sum(s for _, s in self._decode_busy),
                        calibrated=self.num_measured >= MIN_SAMPLES,
                        slo_seats=self.slo_seats(max(decode, 1), self.decode_seats_per_replica * max(decode, 1)))

    def place(self, prompt_tokens: int, prefill_live: int | None, decode_live: int | None,
              tenant: str = DEFAULT_TENANT, priority: int = 0, arrived_at: float = 0.0,
              cached: dict[str, int] | None = None) -> Ticket:
        """A ticket naming where the prompt is prefilled, or BackendOverloaded (429 with Retry-After).
        ``arrived_at``: time.monotonic() when the gateway got the request (0: now); ``cached``: per
        place, the prompt's leading tokens the prefix index says its replicas hold."""
        if self.in_flight >= self.max_in_flight:
            self.num_over_capacity += 1
            metrics.count_admission_rejection("in_flight_cap")
            raise for_client(BackendOverloaded(f"the gateway is serving {self.in_flight} requests "
                                               f"(admission.max_in_flight = {self.max_in_flight}); retry shortly",
                                               retry_after_s=1.0))
        now = time.monotonic()
        who = (priority, tenant)
        snap = self.snapshot(prefill_live, decode_live, now, who, prompt_tokens)
        self._decode_live = max(decode_live or 1, 1)
        slo_seats = snap.slo_seats
        active = self._active(tenant, now)
        # Only on a measured prediction: the step model scaled by TPOTs measured here.
        measured = self.tpot.num_samples >= MIN_SAMPLES
        if self.shed and measured and not may_take_seat(self.streams_of, tenant, snap.decode_seats, self.tenant_weights,
                                           slo_seats, active):
            if snap.decode_streams < snap.decode_seats:
                self.num_seat_shares += 1
                metrics.count_admission_rejection("seat_share")
                raise for_client(BackendOverloaded(
                    f"tenant {tenant!r} holds {self.streams_of.get(tenant, 0)} of the {slo_seats} decode streams "
                    f"the decode pool runs within the {self.rules.tpot_slo_s:g} s TPOT SLO (x {self.headroom:g}), "
                    "its fair share or more while other tenants are sending; retry shortly or add decode replicas",
                    retry_after_s=1.0))
        choice = place(prompt_tokens, snap, self.rules, cached)
        if choice.pool is None:
            self.num_shed += 1
            metrics.count_admission_rejection("slo")
            # placement.py's reasons are numbers and setting names, never replica names
            raise for_client(BackendOverloaded(f"{choice.reason}; retry after {choice.retry_after_s:.0f} s or add "
                                               "replicas", retry_after_s=choice.retry_after_s))
        self.num_past_prediction += choice.past_prediction
        if choice.pool == DECODE:
            self._decode_busy.append((now, choice.local_prefill_s))
        in_outage = (snap.decode if choice.pool == DECODE else snap.prefill).live_replicas <= 0
        return self._enqueue(choice, prompt_tokens, who, now, arrived_at, in_outage)

    def _enqueue(self, choice: Placement, prompt_tokens: int, who: Class, now: float, arrived_at: float,
                 in_outage: bool = False) -> Ticket:
        opened = self.places[choice.pool].admit(who, choice.computed_tokens or prompt_tokens, now, in_outage)
        self.in_flight += 1
        self.streams_of[who[1]] = self.streams_of.get(who[1], 0) + 1
        self.num_admitted += 1
        self.placed[choice.pool] += 1
        self.admitted_prompt_tokens += prompt_tokens
        return Ticket(self, choice, prompt_tokens, who, arrived_at, in_outage, opened_burst=opened)

    def _active(self, tenant: str, now: float) -> list[str]:
        """The tenants that asked within ACTIVE_S (``tenant`` marked as asking now)."""
        self._last_seen[tenant] = now
        if len(self._last_seen) > 256:
            self._last_seen = {t: s for t, s in self._last_seen.items() if s > now - ACTIVE_S}
        return [t for t, s in self._last_seen.items() if s > now - ACTIVE_S]

    def slo_seats(self, decode_replicas: int, seats: int) -> int:
        """Streams the decode pool runs with every step within TPOT SLO x headroom (the step model,
        scaled by the TPOTs measured here), at least one per replica, at most ``seats``."""
        bound = self.rules.tpot_slo_s * self.headroom
        per_replica = self.rules.step.max_batch_within(bound / self.tpot.factor)
        return min(max(per_replica, 1) * decode_replicas, seats)

    def _observe_tpot(self, streams: float, tpot_s: float) -> None:
        self.tpot.observe(self.rules.step.step_s(streams / self._decode_live), tpot_s)

    def _end_stream(self, tenant: str) -> None:
        self.in_flight -= 1
        left = self.streams_of.get(tenant, 0) - 1
        if left > 0:
            self.streams_of[tenant] = left
        else:
            self.streams_of.pop(tenant, None)

    def _dequeue(self, ticket: Ticket, measured_s: float | None, replica: str = "") -> None:
        q = self.places[ticket.pool]
        q.add(ticket.who, ticket.queued, -1, ticket.in_outage)
        if measured_s is not None:
            q.answered(ticket, measured_s, time.monotonic(), replica)

    def view(self) -> dict:
        return {"in_flight": self.in_flight, "shed": self.num_shed, "past_prediction": self.num_past_prediction,
                "over_capacity": self.num_over_capacity,
                "seat_share": self.num_seat_shares, "streams_by_tenant": dict(self.streams_of),
                "tpot_factor": round(self.tpot.factor, 3), "tpot_samples": self.tpot.num_samples,
                "admitted": self.num_admitted, "admitted_prompt_tokens": self.admitted_prompt_tokens,
                "placed": dict(self.placed), "prefill_model": self.rules.prefill.describe("prompt tokens"),
                "step_model": self.rules.step.describe("streams"),
                "pools": {p: {"queued_tokens": q.queued_tokens, "queued_requests": q.queued_requests,
                              "backlog_tokens": q.backlog_tokens,
                              "calibration": {"samples": q.calibration.num_samples,
                                              "offset_s": round(q.calibration.line.offset_s, 4),
                                              "slope": round(q.calibration.line.slope, 3),
                                              "tail_s": round(q.calibration.margin_s, 4),
                                              "left_out": q.samples_left_out}}
                          for p, q in self.places.items()}}
