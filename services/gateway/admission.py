"""Admission at the gateway: which place prefills a request (placement.py's
rule), and a 429 only where that rule predicts the SLO would break.

The gateway sees every request of the cluster (one gateway replica), so its
own counters are exact and current, unlike stats polled from the replicas:

    per place (prefill pool, decode pool)   prompt tokens and requests admitted, no first token yet
    decode_streams                          requests admitted and not finished (each holds a decode seat)
    decode busy                             decode-side prefill seconds placed in the last window
    calibration                             (modelled, measured) TTFT of each place's recent first tokens

The speed model (services/speed/model.py) starts from the configured
profile (autoscaling.speed, what `pdcluster plan --profile` measures) and is
calibrated online from the measured TTFTs (services/speed/calibration.py).
Nothing is refused on a prediction before MIN_SAMPLES first tokens were
measured.  ``place`` decides and counts; the ``Ticket`` it returns gives
the counts back."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

from observability import metrics
from services.backend import BackendOverloaded, for_client
from services.config import AutoscaleSpeed
from services.gateway.placement import DECODE, PREFILL, PlaceLoad, Placement, Rules, Snapshot, place
from services.speed.calibration import Calibration

MIN_SAMPLES = 4  # first tokens measured (any place) before a prediction may refuse

# Until the gateway is built from a config: the config's default speed model.
DEFAULT_RULES = Rules(*AutoscaleSpeed().models())


class PlaceQueue:
    """Prompt tokens admitted to one place and not yet answered with a first token."""

    def __init__(self):
        self.queued_tokens = 0
        self.queued_requests = 0
        self.calibration = Calibration()

    def load(self, live_replicas: int) -> PlaceLoad:
        return PlaceLoad(live_replicas, self.queued_tokens, self.queued_requests, self.calibration.predict,
                         self.calibration.margin_s)


class Ticket:
    """One admitted request: ``first_token()`` when its first token arrives,
    ``close()`` when it ends (either order; both idempotent).  ``pool`` is
    where its prompt is prefilled: "prefill" or "decode"."""

    def __init__(self, admission: Admission, placement: Placement, tokens: int):
        self._admission, self.placement, self.tokens = admission, placement, tokens
        self.pool = placement.pool
        self._admitted_at = time.monotonic()
        self._queued, self._open = True, True

    def first_token(self) -> None:
        if self._queued:
            self._queued = False
            measured = time.monotonic() - self._admitted_at
            self._admission._dequeue(self, measured)

    def close(self) -> None:
        if self._queued:
            self._queued = False
            self._admission._dequeue(self, None)
        if self._open:
            self._open = False
            self._admission.in_flight -= 1


class Admission:
    def __init__(self, ttft_slo_s: float, max_in_flight: int, shed: bool = True, headroom: float = 0.8,
                 rules: Rules | None = None, decode_seats_per_replica: int = 1 << 30):
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        self.rules = replace(rules or DEFAULT_RULES, ttft_slo_s=ttft_slo_s, headroom=headroom, shed=shed)
        self.ttft_slo_s, self.max_in_flight, self.shed, self.headroom = ttft_slo_s, max_in_flight, shed, headroom
        self.decode_seats_per_replica = decode_seats_per_replica
        self.in_flight = 0
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

    def snapshot(self, prefill_live: int | None, decode_live: int | None, now: float) -> Snapshot:
        """``*_live``: live replicas (None: unknown -- no Redis -- counted as one; prefill 0: no prefill pool)."""
        decode = max(decode_live if decode_live is not None else 1, 1)
        prefill_live = 1 if prefill_live is None else prefill_live
        prefill = self.places[PREFILL].load(prefill_live) if prefill_live > 0 else None
        while self._decode_busy and self._decode_busy[0][0] < now - self.rules.window_s:
            self._decode_busy.popleft()
        return Snapshot(prefill=prefill, decode=self.places[DECODE].load(decode),
                        decode_streams=self.in_flight, decode_seats=self.decode_seats_per_replica * decode,
                        decode_busy_s=sum(s for _, s in self._decode_busy),
                        calibrated=self.num_measured >= MIN_SAMPLES)

    def place(self, prompt_tokens: int, prefill_live: int | None, decode_live: int | None) -> Ticket:
        """A ticket naming where the prompt is prefilled, or BackendOverloaded (429 with Retry-After)."""
        if self.in_flight >= self.max_in_flight:
            self.num_over_capacity += 1
            metrics.count_admission_rejection("in_flight_cap")
            raise for_client(BackendOverloaded(f"the gateway is serving {self.in_flight} requests "
                                               f"(admission.max_in_flight = {self.max_in_flight}); retry shortly",
                                               retry_after_s=1.0))
        now = time.monotonic()
        choice = place(prompt_tokens, self.snapshot(prefill_live, decode_live, now), self.rules)
        if choice.pool is None:
            self.num_shed += 1
            metrics.count_admission_rejection("slo")
            # placement.py's reasons are numbers and setting names, never replica names
            raise for_client(BackendOverloaded(f"{choice.reason}; retry after {choice.retry_after_s:.0f} s or add "
                                               "replicas", retry_after_s=choice.retry_after_s))
        if choice.pool == DECODE:
            self._decode_busy.append((now, choice.local_prefill_s))
        return self._enqueue(choice, prompt_tokens, now)

    def _enqueue(self, choice: Placement, prompt_tokens: int, now: float) -> Ticket:
        q = self.places[choice.pool]
        q.queued_tokens += prompt_tokens
        q.queued_requests += 1
        self.in_flight += 1
        self.num_admitted += 1
        self.placed[choice.pool] += 1
        self.admitted_prompt_tokens += prompt_tokens
        return Ticket(self, choice, prompt_tokens)

    def _dequeue(self, ticket: Ticket, measured_s: float | None) -> None:
        q = self.places[ticket.pool]
        q.queued_tokens -= ticket.tokens
        q.queued_requests -= 1
        if measured_s is not None:
            q.calibration.observe(ticket.placement.modelled_ttft_s, measured_s)

    def view(self) -> dict:
        return {"in_flight": self.in_flight, "shed": self.num_shed, "over_capacity": self.num_over_capacity,
                "admitted": self.num_admitted, "admitted_prompt_tokens": self.admitted_prompt_tokens,
                "placed": dict(self.placed), 
                "pools": {p: {"queued_tokens": q.queued_tokens, "queued_requests": q.queued_requests,
                              "calibration": {"samples": q.calibration.num_samples,
                                              "offset_s": round(q.calibration.line.offset_s, 4),
                                              "slope": round(q.calibration.line.slope, 3),
                                              "tail_s": round(q.calibration.margin_s, 4)}}
                          for p, q in self.places.items()}}
