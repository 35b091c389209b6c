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
Nothing is refused on a prediction before MIN_SAMPLES first tokens were
measured.  ``place`` decides and counts; the ``Ticket`` it returns gives
the counts back."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

from pdcluster.observability import metrics
from pdcluster.planning.calibration import Calibration, RatioCalibration
from pdcluster.services.backend import BackendOverloaded, for_client
from pdcluster.services.config import AutoscaleSpeed
from pdcluster.services.engine.sampling_params import DEFAULT_TENANT
from pdcluster.services.gateway.fair_share import Class, may_take_seat, tokens_ahead
from pdcluster.services.gateway.placement import DECODE, PREFILL, PlaceLoad, Placement, Rules, Snapshot, place

MIN_SAMPLES = 4  # first tokens measured (any place) before a prediction may refuse
ACTIVE_S = 30.0  # a tenant that sent a request this recently shares the decode seats
MIN_TPOT_TOKENS = 8  # a stream's TPOT calibrates the decode step model from this many tokens on

# Until the gateway is built from a config: the config's default speed model.
DEFAULT_RULES = Rules(*AutoscaleSpeed().models())


class PlaceQueue:
    """Prompt tokens admitted to one place and not yet answered with a first token."""

    def __init__(self):
        self.queued_tokens = 0
        self.queued_requests = 0
        self.by_class: dict[Class, int] = {}  # queued prompt tokens per (priority, tenant)
        self.calibration = Calibration()

    def load(self, live_replicas: int, who: Class | None = None, prompt_tokens: int = 0,
             weights: dict[str, float] | None = None) -> PlaceLoad:
        """The place as a request of class ``who`` sees it: the queued work it waits behind."""
        ahead = self.queued_tokens if who is None else tokens_ahead(self.by_class, who[1], who[0], prompt_tokens,
                                                                   weights or {})
        return PlaceLoad(live_replicas, ahead, self.queued_requests if ahead else 0, self.calibration.predict,
                         self.calibration.margin_s)

    def add(self, who: Class, tokens: int, sign: int) -> None:
        self.queued_tokens += sign * tokens
        self.queued_requests += sign
        left = self.by_class.get(who, 0) + sign * tokens
        if left or sign > 0:
            self.by_class[who] = left
        else:
            self.by_class.pop(who, None)


class Ticket:
    """One admitted request: ``first_token()`` when its first token arrives,
    ``close()`` when it ends (either order; both idempotent).  ``pool`` is
    where its prompt is prefilled: "prefill" or "decode"."""

    def __init__(self, admission: Admission, placement: Placement, tokens: int, who: Class = (0, DEFAULT_TENANT)):
        self._admission, self.placement, self.tokens, self.who = admission, placement, tokens, who
        self.pool = placement.pool
        self._admitted_at = time.monotonic()
        self._queued, self._open = True, True
        self._streams_at_start = admission.in_flight + 1  # the decode batch it joins (itself included)
        self._first_s = self._last_s = 0.0
        self._num_tokens = 0

    def first_token(self, num_tokens: int = 1) -> None:
        """A chunk of ``num_tokens`` came out (the first one: its first token)."""
        now = time.monotonic()
        if self._queued:
            self._queued = False
            self._first_s = now
            self._admission._dequeue(self, now - self._admitted_at)
        self._num_tokens += num_tokens
        self._last_s = now

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
                 tenant_weights: dict[str, float] | None = None):
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
        self.places = {PREFILL: PlaceQueue(), DECODE: PlaceQueue()}
        self._decode_busy: deque[tuple[float, float]] = deque()  # (when placed, seconds of decode time)
        self.num_shed = 0
        self.num_over_capacity = 0
        self.num_admitted = 0
        self.placed = {PREFILL: 0, DECODE: 0}
        self.admitted_prompt_tokens = 0  # whichever pool prefills them: the autoscaler's prompt mean

    @property
    def num_measured(self) -> int:
        return sum(q.calibration.num_samples for q in self.places.values())

    def snapshot(self, prefill_live: int | None, decode_live: int | None, now: float, who: Class | None = None,
                 prompt_tokens: int = 0) -> Snapshot:
        """``*_live``: live replicas (None: unknown -- no Redis -- counted as one; prefill 0: no prefill pool);
        ``who``: the class of the request it is for (None: the whole queues)."""
        decode = max(decode_live if decode_live is not None else 1, 1)
        prefill_live = 1 if prefill_live is None else prefill_live
        w = self.tenant_weights
        prefill = self.places[PREFILL].load(prefill_live, who, prompt_tokens, w) if prefill_live > 0 else None
        while self._decode_busy and self._decode_busy[0][0] < now - self.rules.window_s:
            self._decode_busy.popleft()
        return Snapshot(prefill=prefill, decode=self.places[DECODE].load(decode, who, prompt_tokens, w),
                        decode_streams=self.in_flight, decode_seats=self.decode_seats_per_replica * decode,
                        decode_busy_s=sum(s for _, s in self._decode_busy),
                        calibrated=self.num_measured >= MIN_SAMPLES)

    def place(self, prompt_tokens: int, prefill_live: int | None, decode_live: int | None,
              tenant: str = DEFAULT_TENANT, priority: int = 0) -> Ticket:
        """A ticket naming where the prompt is prefilled, or BackendOverloaded (429 with Retry-After)."""
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
        slo_seats = self.slo_seats(self._decode_live, snap.decode_seats)
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
        choice = place(prompt_tokens, snap, self.rules)
        if choice.pool is None:
            self.num_shed += 1
            metrics.count_admission_rejection("slo")
            # placement.py's reasons are numbers and setting names, never replica names
            raise for_client(BackendOverloaded(f"{choice.reason}; retry after {choice.retry_after_s:.0f} s or add "
                                               "replicas", retry_after_s=choice.retry_after_s))
        if choice.pool == DECODE:
            self._decode_busy.append((now, choice.local_prefill_s))
        return self._enqueue(choice, prompt_tokens, who)

    def _enqueue(self, choice: Placement, prompt_tokens: int, who: Class) -> Ticket:
        self.places[choice.pool].add(who, prompt_tokens, +1)
        self.in_flight += 1
        self.streams_of[who[1]] = self.streams_of.get(who[1], 0) + 1
        self.num_admitted += 1
        self.placed[choice.pool] += 1
        self.admitted_prompt_tokens += prompt_tokens
        return Ticket(self, choice, prompt_tokens, who)

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

    def _dequeue(self, ticket: Ticket, measured_s: float | None) -> None:
        q = self.places[ticket.pool]
        q.add(ticket.who, ticket.tokens, -1)
        if measured_s is not None:
            q.calibration.observe(ticket.placement.modelled_ttft_s, measured_s)

    def view(self) -> dict:
        return {"in_flight": self.in_flight, "shed": self.num_shed, "over_capacity": self.num_over_capacity,
                "seat_share": self.num_seat_shares, "streams_by_tenant": dict(self.streams_of),
                "tpot_factor": round(self.tpot.factor, 3), "tpot_samples": self.tpot.num_samples,
                "admitted": self.num_admitted, "admitted_prompt_tokens": self.admitted_prompt_tokens,
                "placed": dict(self.placed), 
                "pools": {p: {"queued_tokens": q.queued_tokens, "queued_requests": q.queued_requests,
                              "calibration": {"samples": q.calibration.num_samples,
                                              "offset_s": round(q.calibration.line.offset_s, 4),
                                              "slope": round(q.calibration.line.slope, 3),
                                              "tail_s": round(q.calibration.margin_s, 4)}}
                          for p, q in self.places.items()}}
