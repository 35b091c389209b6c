"""Load shedding by SLO, at the gateway.

The rule (Little's law on prompt tokens, per pool that prefills):

    cost           = a request's prompt tokens + a fixed per-request overhead (in tokens)
    queued_tokens  = the cost of requests admitted to the pool whose first token has not come back
    rate_tps       = cost the pool finished per second of busy time (its last completions)
    predicted_ttft = (queued_tokens + this request's cost) / rate_tps

    admit  when  fewer than MIN_SAMPLES completions are measured, or the queue is
                 empty, or predicted_ttft <= ttft_slo_s x headroom
    refuse with 429 and Retry-After = the time for the excess to drain, otherwise

The headroom (0.6 by default) absorbs the prediction's noise (a rate
measured over recent completions, scheduling jitter), so that admitted
requests meet the SLO rather than straddle it.  The overhead keeps tiny prompts (a one-step prefill costs about as much as
a few dozen prompt tokens) from making the pool look slow, and the first
completions (cold caches, a readiness probe) from poisoning the rate.

An empty queue always admits: a prompt too long to meet the SLO on an idle
pool can never meet it, and refusing it forever would be worse than serving
it late.  Busy time, not wall time, is the denominator, so an idle spell
does not make the pool look slow.  The gateway sees every request of the
cluster (one gateway replica), so its own count of queued tokens is exact
and current, unlike stats polled from the replicas.

``decide`` is the pure rule; ``Admission`` holds the counters it reads."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from observability import metrics
from services.backend import BackendOverloaded

_RATE_WINDOW = 32  # completions the rate is measured over
MIN_SAMPLES = 4    # completions measured before anything is shed
REQUEST_OVERHEAD_TOKENS = 32


@dataclass(frozen=True)
class AdmissionDecision:
    admit: bool
    predicted_ttft_s: float | None  # None: no measured rate yet
    retry_after_s: float = 0.0


def decide(queued_tokens: int, prompt_tokens: int, rate_tps: float | None, ttft_slo_s: float) -> AdmissionDecision:
    if rate_tps is None or rate_tps <= 0:
        return AdmissionDecision(True, None)
    predicted = (queued_tokens + prompt_tokens) / rate_tps
    if queued_tokens == 0 or predicted <= ttft_slo_s:
        return AdmissionDecision(True, predicted)
    return AdmissionDecision(False, predicted, retry_after_s=max(1.0, math.ceil(predicted - ttft_slo_s)))


class PoolRate:
    """Prompt tokens per busy second of one pool, from recent first tokens.

    A completion at time t after a busy reference r (the previous completion,
    or the moment the pool last went from idle to busy) contributes
    (tokens, t - r); the rate is the window's tokens over its seconds."""

    def __init__(self, window: int = _RATE_WINDOW):
        self.queued_tokens = 0
        self.queued_requests = 0
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._reference_s: float | None = None  # None while idle

    def enqueue(self, tokens: int, now: float) -> None:
        if self.queued_requests == 0:
            self._reference_s = now
        self.queued_tokens += tokens
        self.queued_requests += 1

    def dequeue(self, tokens: int, now: float, completed: bool) -> None:
        self.queued_tokens -= tokens
        self.queued_requests -= 1
        if completed and self._reference_s is not None:
            self._samples.append((tokens, max(now - self._reference_s, 1e-6)))
            self._reference_s = now
        if self.queued_requests == 0:
            self._reference_s = None

    @property
    def rate_tps(self) -> float | None:
        """None until MIN_SAMPLES completions were measured."""
        if len(self._samples) < MIN_SAMPLES:
            return None
        return sum(t for t, _ in self._samples) / sum(s for _, s in self._samples)


class Ticket:
    """One admitted request: ``first_token()`` when its first token arrives,
    ``close()`` when it ends (either order; both idempotent)."""

    def __init__(self, admission: Admission, pool: str, tokens: int):
        self._admission, self.pool, self.tokens = admission, pool, tokens
        self._queued, self._open = True, True

    def first_token(self) -> None:
        if self._queued:
            self._queued = False
            self._admission.rates[self.pool].dequeue(self.tokens, time.monotonic(), completed=True)

    def close(self) -> None:
        if self._queued:
            self._queued = False
            self._admission.rates[self.pool].dequeue(self.tokens, time.monotonic(), completed=False)
        if self._open:
            self._open = False
            self._admission.in_flight -= 1


class Admission:
    def __init__(self, ttft_slo_s: float, max_in_flight: int, shed: bool = True, headroom: float = 0.6):
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        self.ttft_slo_s, self.max_in_flight, self.shed, self.headroom = ttft_slo_s, max_in_flight, shed, headroom
        self.in_flight = 0
        self.rates: dict[str, PoolRate] = {}
        self.num_shed = 0
        self.num_over_capacity = 0
        self.num_admitted = 0
        self.admitted_prompt_tokens = 0  # whichever pool prefills them: the autoscaler's prompt mean

    def admit(self, pool: str, prompt_tokens: int) -> Ticket:
        """A ticket, or BackendOverloaded (429 with Retry-After)."""
        cost = prompt_tokens + REQUEST_OVERHEAD_TOKENS
        if self.in_flight >= self.max_in_flight:
            self.num_over_capacity += 1
            metrics.count_admission_rejection("in_flight_cap")
            raise BackendOverloaded(f"the gateway is serving {self.in_flight} requests (admission.max_in_flight "
                                    f"= {self.max_in_flight}); retry shortly", retry_after_s=1.0)
        rate = self.rates.setdefault(pool, PoolRate())
        if self.shed:
            d = decide(rate.queued_tokens, cost, rate.rate_tps, self.ttft_slo_s * self.headroom)
            if not d.admit:
                self.num_shed += 1
                metrics.count_admission_rejection("slo")
                raise BackendOverloaded(
                    f"the {pool} pool is overloaded: {rate.queued_tokens} prompt tokens (with per-request "
                    f"overhead) queued at {rate.rate_tps:.0f} tokens/s predict a time to first token of "
                    f"{d.predicted_ttft_s:.1f} s, "
                    f"over {self.headroom:g} x the {self.ttft_slo_s:g} s SLO (admission.ttft_slo_s); retry after "
                    f"{d.retry_after_s:.0f} s or add {pool} replicas", retry_after_s=d.retry_after_s)
        rate.enqueue(cost, time.monotonic())
        self.in_flight += 1
        self.num_admitted += 1
        self.admitted_prompt_tokens += prompt_tokens
        return Ticket(self, pool, cost)

    def view(self) -> dict:
        return {"in_flight": self.in_flight, "shed": self.num_shed, "over_capacity": self.num_over_capacity,
                "admitted": self.num_admitted, "admitted_prompt_tokens": self.admitted_prompt_tokens,
                "pools": {p: {"queued_tokens": r.queued_tokens, "queued_requests": r.queued_requests,
                              "rate_tps": r.rate_tps} for p, r in self.rates.items()}}
