"""A closed loop of C clients on one prefill + one decode replica, played
step by step the way the two engines schedule (pdcluster/services/engine/scheduler.py),
with the speeds a profile measured.  Pure and deterministic: the same inputs
give the same timings.

    clients     C at once at t = 0 (the load generator starts every worker
                together), each sending its next request when the last ends
    arrival     a request reaches the prefill engine ``overhead_s`` after it
                is sent (HTTP, tokenizing, routing), ``prefill_delay_s``
                later when it is sent while the decode engine computes (its
                way waits for the cores), plus a draw of N(0,
                ``arrival_jitter_s``) (never before it is sent): on a real
                machine no two requests take the same time, so a closed
                loop's clients drift in and out of phase and now and then
                one queues behind another's prefill, which a jitter-free
                loop settles out of for good
    prefill     one step at a time; a step takes the waiting prompts first
                come first served, at most ``prefill_chunk_size`` tokens of
                one prompt and ``max_num_batched_tokens`` in all (a longer
                prompt goes on in later steps); a prompt arriving during a
                step waits for the next.  Step time = prefill_busy(tokens);
                a prompt's last step ends with its first token (TTFT)
    hand-off    the sequence joins the decode engine ``handoff_s`` later
    decode      steps back to back while any sequence runs; a step carries
                every sequence that has joined by its start, one token each;
                step time = decode_step(batch, mean context of the batch)
    overlap     the replicas share the machine's cores and memory: a prefill
                step runs ``prefill_slowdown`` times slower while the decode
                engine computes (its end moves when decoding starts or
                stops); a decode step that starts while a prefill runs takes
                ``decode_slowdown`` times as long (both measured by the
                profile's overlap probe)

Per request, as the load generator measures it: TTFT (send to first token),
TPOT ((E2E - TTFT) / (output - 1)) and E2E (send to last token).  The
jitter's draws come from ``seed``: the same inputs and seed give the same
timings.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Speeds:
    overhead_s: float  # send to reaching the prefill engine
    prefill_busy_s: Callable[[int], float]  # one prefill step computing this many prompt tokens
    decode_step_s: Callable[[int, float], float]  # one decode step: batch, mean context tokens
    handoff_s: float = 0.0  # first token to joining the decode engine
    prefill_slowdown: float = 1.0  # a prefill step started while the decode replica computes
    decode_slowdown: float = 1.0  # a decode step started while the prefill replica computes
    prefill_delay_s: float = 0.0  # added to overhead_s for a request sent while the decode replica computes
    arrival_jitter_s: float = 0.0  # standard deviation of a request's way to the prefill engine

    def __post_init__(self) -> None:
        if min(self.overhead_s, self.handoff_s, self.prefill_delay_s, self.arrival_jitter_s) < 0:
            raise ValueError(f"overhead_s ({self.overhead_s}), handoff_s ({self.handoff_s}), prefill_delay_s "
                             f"({self.prefill_delay_s}) and arrival_jitter_s ({self.arrival_jitter_s}) must be >= 0")
        if self.prefill_slowdown < 1 or self.decode_slowdown < 1:
            raise ValueError("slowdowns are >= 1 (a step never runs faster for the other replica's work), got "
                             f"prefill {self.prefill_slowdown}, decode {self.decode_slowdown}")


@dataclass(frozen=True)
class EngineLimits:
    max_num_batched_tokens: int = 1024
    prefill_chunk_size: int = 512
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if min(self.max_num_batched_tokens, self.prefill_chunk_size, self.max_num_seqs) < 1:
            raise ValueError(f"engine limits must be >= 1, got {self}")


@dataclass(frozen=True)
class Workload:
    clients: int
    requests_per_client: int
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if min(self.clients, self.requests_per_client, self.prompt_tokens, self.output_tokens) < 1:
            raise ValueError(f"every workload figure must be >= 1, got {self}")


@dataclass(frozen=True)
class RequestTiming:
    client: int
    send_s: float
    ttft_s: float
    e2e_s: float
    output_tokens: int

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(self.output_tokens - 1, 1)


@dataclass
class _Sequence:
    client: int
    send_s: float
    prompt_left: int
    context: int = 0  # tokens whose K/V exist (prompt computed + tokens generated)
    generated: int = 0
    first_token_s: float = 0.0


@dataclass
class _Engines:
    speeds: Speeds
    limits: EngineLimits
    work: Workload
    events: list = field(default_factory=list)
    order: itertools.count = field(default_factory=itertools.count)
    prefill_queue: deque = field(default_factory=deque)  # arrived, prompt not finished
    prefill_busy: bool = False
    prefill_end_s: float = 0.0  # when the running prefill step ends at its current pace
    prefill_pace: float = 1.0  # its current slowdown
    prefill_step: list = field(default_factory=list)
    prefill_version: int = 0  # a prefill_done event of an older version was moved
    decode_ready: list = field(default_factory=list)  # joined, not yet in a step
    decode_running: list = field(default_factory=list)
    decode_busy: bool = False
    timings: list = field(default_factory=list)
    sent: dict = field(default_factory=dict)  # client -> requests sent
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # seeded: the loop is repeatable

    def at(self, t: float, kind: str, payload=None) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, payload))

    def send(self, client: int, t: float) -> None:
        self.sent[client] = self.sent.get(client, 0) + 1
        seq = _Sequence(client, t, self.work.prompt_tokens)
        decoding = self.decode_busy or self.decode_running or self.decode_ready  # others' tokens still stream
        way = self.speeds.overhead_s + (self.speeds.prefill_delay_s if decoding else 0.0)
        if self.speeds.arrival_jitter_s > 0:
            way = max(way + self.rng.gauss(0.0, self.speeds.arrival_jitter_s), 0.0)
        self.at(t + way, "arrive", seq)

    def start_prefill(self, t: float) -> None:
        budget, step = self.limits.max_num_batched_tokens, []
        for seq in self.prefill_queue:
            if budget <= 0:
                break
            chunk = min(seq.prompt_left, self.limits.prefill_chunk_size, budget)
            step.append((seq, chunk))
            budget -= chunk
        tokens = sum(chunk for _, chunk in step)
        self.prefill_busy, self.prefill_step = True, step
        self.prefill_pace = self.speeds.prefill_slowdown if self.decode_busy else 1.0
        self.prefill_end_s = t + self.speeds.prefill_busy_s(tokens) * self.prefill_pace
        self.prefill_version += 1
        self.at(self.prefill_end_s, "prefill_done", self.prefill_version)

    def repace_prefill(self, t: float) -> None:
        """Decoding started or stopped: the running prefill step's rest goes at the new pace."""
        pace = self.speeds.prefill_slowdown if self.decode_busy else 1.0
        if not self.prefill_busy or pace == self.prefill_pace:
            return
        self.prefill_end_s = t + (self.prefill_end_s - t) / self.prefill_pace * pace
        self.prefill_pace = pace
        self.prefill_version += 1
        self.at(self.prefill_end_s, "prefill_done", self.prefill_version)

    def prefill_done(self, t: float, version: int) -> None:
        if version != self.prefill_version:
            return  # moved: a later event ends this step
        self.prefill_busy, step = False, self.prefill_step
        for seq, chunk in step:
            seq.prompt_left -= chunk
            seq.context += chunk
            if seq.prompt_left == 0:
                self.prefill_queue.remove(seq)
                seq.generated, seq.first_token_s = 1, t
                if self.work.output_tokens == 1:
                    self.finish(seq, t)
                else:
                    self.at(t + self.speeds.handoff_s, "join", seq)

    def start_decode(self, t: float) -> None:
        room = self.limits.max_num_seqs - len(self.decode_running)
        self.decode_running += self.decode_ready[:room]
        del self.decode_ready[:room]
        batch = len(self.decode_running)
        context = sum(s.context for s in self.decode_running) / batch
        slow = self.speeds.decode_slowdown if self.prefill_busy else 1.0
        self.decode_busy = True
        self.at(t + self.speeds.decode_step_s(batch, context) * slow, "decode_done")

    def decode_done(self, t: float) -> None:
        self.decode_busy = False
        done, still = [], []
        for seq in self.decode_running:
            seq.generated += 1
            seq.context += 1
            (done if seq.generated == self.work.output_tokens else still).append(seq)
        self.decode_running = still
        for seq in done:
            self.finish(seq, t)

    def finish(self, seq: _Sequence, t: float) -> None:
        self.timings.append(RequestTiming(seq.client, seq.send_s, seq.first_token_s - seq.send_s, t - seq.send_s,
                                          self.work.output_tokens))
        if self.sent[seq.client] < self.work.requests_per_client:
            self.send(seq.client, t)

    def run(self) -> list[RequestTiming]:
        for client in range(self.work.clients):
            self.send(client, 0.0)
        while self.events:
            # one event at a time, a step starting after each: requests reach an engine one by one (the gateway
            # handles them in turn), so of two sent at one instant the first starts a step alone
            t, _, kind, payload = heapq.heappop(self.events)
            decoding = self.decode_busy
            if kind == "arrive":
                self.prefill_queue.append(payload)
            elif kind == "prefill_done":
                self.prefill_done(t, payload)
            elif kind == "join":
                self.decode_ready.append(payload)
            else:
                self.decode_done(t)
            if not self.prefill_busy and self.prefill_queue:
                self.start_prefill(t)
            if not self.decode_busy and (self.decode_running or self.decode_ready):
                self.start_decode(t)
            if self.decode_busy != decoding:
                self.repace_prefill(t)
        return sorted(self.timings, key=lambda r: (r.send_s, r.client))


def simulate(speeds: Speeds, work: Workload, limits: EngineLimits = EngineLimits(),
             seed: int = 0) -> list[RequestTiming]:
    """Every request of the closed loop, in send order."""
    return _Engines(speeds, limits, work, rng=random.Random(seed)).run()
