"""Where a prompt is prefilled, and whether it is admitted at all.

Two places can prefill a prompt: the prefill pool (then the KV moves to a
decode replica), or the decode replica that will decode it (no transfer,
but its streams wait while it computes).  For each place p, from one
snapshot of the gateway's own counters:

    work       = prompt tokens queued at p (admitted, no first token yet) + this prompt's, each
                 less the leading blocks the prefix index says p's replicas hold (``cached``):
                 a chat's turn computes its new message, not its history
    per_rep    = work / live replicas of p
    join       = prompts that will share its last engine step: the room left in that step
                 (-per_rep mod the step's prompt tokens), at most what arrives at p per replica
                 in one full step's time (an engine step prefills every prompt waiting when it
                 starts, and answers them all at its end: under load the last step is full)
    short first: at a decode replica (or a colocated one) a prompt of at most long_prefill_tokens
                 goes ahead of longer ones (the engine's scheduler: a long prefill takes what each
                 step leaves), so its work leaves out the long prompts queued there, and while
                 any are queued its steps count full (their leftover goes to a long chunk)
    steps      = ceil((per_rep + join) / prompt tokens one step takes there)
    modelled   = steps x (step overhead [+ the rows of the streams beside it, on decode])
                 + per_token x (per_rep + join) + per_token2 x (prompt^2 + the queued prompts' squares / replicas)
    ttft_p     = calibrated(modelled)          (pdcluster/planning/calibration.py: measured vs modelled)

The decode replica may prefill only while its streams keep their TPOT:

    busy       = (decode-side prefill seconds placed in the last window + this prompt's) / (window x replicas)
    tpot       = step(streams per replica + 1) / (1 - busy)          <= tpot_slo x headroom
    local      = this prompt's prefill time there                     <= max_local_prefill_s
                 (its streams pause for its chunks, and later prompts placed there wait behind
                 it: a long prompt would close the decode replica to the short ones)

    place   = the eligible place with the earliest ttft; the decode pool when the prefill pool
              has no live replica (dead, scaled to zero, or colocated mode), whatever its streams'
              TPOT: serving late beats refusing what can be served
    refuse  (429, Retry-After = the excess) only when
                ttft(place) + tail > ttft_slo x headroom        (tail: how far the slowest 20th of
                                                                 the place's recent TTFTs landed above
                                                                 the calibrated line)
              and the place already has queued work             (an idle place cannot do better later)
              and the prompt is long (over long_prefill_tokens, else decode_step_tokens), or the work
                  is not a fresh burst, or the decode pool already runs the streams it keeps within
                  TPOT SLO x headroom (``slo_seats``)           (a burst is the prompts that reach an
                                                                 idle place before the first token of
                                                                 one that waited there (the first ran
                                                                 alone on an idle engine, often done
                                                                 before the burst has all arrived:
                                                                 closing there refused the tail of a
                                                                 client's burst of 16 in 2 runs of 15,
                                                                 Zen 4): nothing measured says the
                                                                 cluster is overloaded -- a closed-loop
                                                                 client's first burst, 8 simultaneous
                                                                 streams on an idle cluster -- and a
                                                                 refusal re-sent at once by a closed-loop
                                                                 client would find the same queue: its
                                                                 16 slots spent 38 of 48 prompts on 429s
                                                                 in 4 s while 10 were served, Zen 4;
                                                                 a short prompt late costs the streams
                                                                 beside it a step, a long one seconds
                                                                 of their TPOT: four 3k prompts admitted
                                                                 whole on the colocated replica cost 7
                                                                 of 37 chats their TPOT SLO, same class)
              and the model is calibrated                       (enough first tokens measured)
              and the place has a live replica and no outage backlog  (prompts admitted while it had
                                                                 none: its queue waits for a replica to
                                                                 start -- a respawn, a scale-up -- not
                                                                 for its speed, and the replica that
                                                                 comes up serves that backlog in its
                                                                 first steps; the in-flight cap and the
                                                                 decode seats still bound the queue)
            or when the decode pool has no seat left (every stream needs one; a decode replica
              must never refuse a stream after its first token)

``place`` is the pure rule; ``Admission`` (admission.py) takes the snapshot
and holds the counters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from pdcluster.planning.speed import PrefillModel, StepModel

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class PlaceLoad:
    """One place that can prefill, as the gateway counts it."""
    live_replicas: int
    queued_tokens: int = 0          # admitted there, no first token yet (this prompt excluded)
    queued_requests: int = 0
    calibrated: Callable[[float], float] = field(default=lambda s: s, compare=False)
    tail_s: float = 0.0             # how far its slowest recent TTFTs landed above the calibrated line
    arriving_tokens_per_s: float = 0.0  # prompt tokens admitted here per second, lately
    queued_long_tokens: int = 0     # of queued_tokens: prompts over Rules.long_prefill_tokens (short first)
    backlog_tokens: int = 0         # of queued_tokens: admitted while the place had no live replica
    queued_square_tokens: float = 0.0   # the sum of the queued prompts' squared lengths (their attention)
    queued_long_square_tokens: float = 0.0  # of it: the long prompts'
    fresh_burst: bool = False       # every prompt queued here arrived after it was idle, before a waiting one's first token


@dataclass(frozen=True)
class Snapshot:
    prefill: PlaceLoad | None       # None: no live prefill replica (or colocated mode)
    decode: PlaceLoad               # the decode (or colocated) pool
    decode_streams: int = 0         # streams the decode pool runs (admitted, not finished)
    decode_seats: int = 1 << 30     # streams it can hold in all (batch seats + queue, x replicas)
    decode_busy_s: float = 0.0      # prefill seconds placed on decode replicas within the window
    calibrated: bool = True         # enough first tokens measured to refuse on a prediction
    slo_seats: int = 0              # streams the decode pool runs within TPOT SLO x headroom (a fresh burst's bound)


@dataclass(frozen=True)
class Rules:
    prefill: PrefillModel           # one prompt alone on an idle replica
    step: StepModel                 # a decode step vs batch
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    headroom: float = 0.8           # refuse/keep-TPOT at this fraction of each SLO
    batch_tokens: int = 1024        # prompt tokens one prefill-pool step takes
    decode_step_tokens: int = 256   # prompt tokens one decode-replica step takes beside its decodes
    window_s: float = 10.0          # the decode replicas' busy share is measured over this
    max_local_prefill_s: float = 1.0  # the longest prefill a decode replica takes on while a prefill replica lives
    long_prefill_tokens: int = 0    # decode/colocated replicas prefill prompts of at most this first (0: in order)
    shed: bool = True


@dataclass(frozen=True)
class Placement:
    pool: str | None                # PREFILL | DECODE; None: refused
    predicted_ttft_s: float
    modelled_ttft_s: float = 0.0    # before calibration: what the calibration compares against
    local_prefill_s: float = 0.0    # seconds of decode-replica time this prompt takes (DECODE only)
    reason: str = ""                # why here (counted), or why refused
    retry_after_s: float = 0.0
    live_replicas: int = 1          # the place's live replicas, and the streams per replica it decodes
    beside_streams: float | None = None  # beside the prompt (None: a prefill replica): what the model assumed
    computed_tokens: int = 0        # of the prompt: what the place is expected to compute (less its cached prefix)
    past_prediction: bool = False   # admitted although predicted late: a short prompt of a fresh burst


def is_long_prompt(prompt_tokens: int, long_prefill_tokens: int) -> bool:
    """Whether a prompt yields to shorter ones at a place that takes short ones first (pure;
    never when ``long_prefill_tokens`` is 0: arrival order)."""
    return 0 < long_prefill_tokens < prompt_tokens


def modelled_ttft_s(prompt_tokens: int, load: PlaceLoad, rules: Rules, beside_streams: float | None = None,
                    joining: bool = True, prompt_square: float | None = None) -> float:
    """The uncalibrated time to a first token at a place (pure); ``beside_streams``: the streams
    per replica it decodes meanwhile (a decode replica), None for a prefill replica; ``joining``:
    with the prompts expected to join its last step (False: ``load.queued_tokens`` is all of it);
    ``prompt_square``: its attention's share when not ``prompt_tokens``^2 (a cached prefix)."""
    p = rules.prefill
    replicas = max(load.live_replicas, 1)
    short_first = (beside_streams is not None and rules.long_prefill_tokens > 0
                   and not is_long_prompt(prompt_tokens, rules.long_prefill_tokens))
    longs = min(load.queued_long_tokens, load.queued_tokens) if short_first else 0
    per_replica = (load.queued_tokens - longs + prompt_tokens) / replicas
    step_tokens = max(rules.batch_tokens if beside_streams is None else rules.decode_step_tokens, 1)
    # The streams beside it decode in the same steps: their rows, not a decode step of their own
    # (a 256-token chunk took 60 ms alone and 67.5 ms beside 16 decodes, whose own step took 17 ms;
    # Sapphire Rapids, 2 threads).
    step_extra = rules.step.rows_s(beside_streams) if beside_streams else 0.0
    if joining and load.arriving_tokens_per_s > 0:
        full_step_s = p.overhead_s + step_extra + p.per_token_s * step_tokens
        per_replica += min(-per_replica % step_tokens, load.arriving_tokens_per_s / replicas * full_step_s)
    steps = max(math.ceil(per_replica / step_tokens), 1)
    if longs:  # a long prompt's chunk fills what each of those steps leaves
        per_replica = min(steps * step_tokens, per_replica + longs / replicas)
    squares = load.queued_square_tokens - (load.queued_long_square_tokens if longs else 0.0)
    return (steps * (p.overhead_s + step_extra) + p.per_token_s * per_replica
            + p.per_token2_s * ((prompt_tokens ** 2 if prompt_square is None else prompt_square)
                                + max(squares, 0.0) / replicas))


def local_prefill_s(prompt_tokens: int, rules: Rules, prompt_square: float | None = None) -> float:
    """``prompt_tokens`` to compute (``prompt_square``: their attention's share when a cached prefix
    leaves it other than ``prompt_tokens``^2)."""
    p = rules.prefill
    return p.per_token_s * prompt_tokens + p.per_token2_s * (prompt_tokens ** 2 if prompt_square is None
                                                           else prompt_square)


@dataclass(frozen=True)
class Work:
    """What a prompt costs a place: the tokens it computes, and their attention's share (each
    computed token attends to the whole prompt so far: tokens^2 - cached^2)."""
    tokens: int
    square: float

    @classmethod
    def of(cls, prompt_tokens: int, cached_tokens: int = 0) -> "Work":
        """At least one token is computed: the first token's logits need it."""
        cached = min(max(cached_tokens, 0), max(prompt_tokens - 1, 0))
        return cls(prompt_tokens - cached, float(prompt_tokens ** 2 - cached ** 2))


def decode_keeps_tpot(prompt_tokens: int, snap: Snapshot, rules: Rules, prompt_square: float | None = None
                      ) -> tuple[bool, str]:
    """Whether the decode replicas' streams keep their TPOT if this prompt (``prompt_tokens`` to
    compute) is prefilled there."""
    replicas = max(snap.decode.live_replicas, 1)
    local = local_prefill_s(prompt_tokens, rules, prompt_square)
    busy = (snap.decode_busy_s + local) / (rules.window_s * replicas)
    if busy >= 1.0:
        return False, f"decode replicas already {busy:.0%} busy prefilling"
    tpot = rules.step.step_s(snap.decode_streams / replicas + 1) / (1.0 - busy)
    if tpot > rules.tpot_slo_s * rules.headroom:
        return False, f"TPOT would reach {tpot * 1e3:.0f} ms"
    if local > rules.max_local_prefill_s:
        return False, f"its prefill would take the decode replica {local:.2f} s"
    return True, ""


def place(prompt_tokens: int, snap: Snapshot, rules: Rules, cached: dict[str, int] | None = None) -> Placement:
    """Where ``prompt_tokens`` is prefilled, or a refusal (pure); ``cached``: per place, the
    prompt's leading tokens its replicas hold (the prefix index's answer; none: computed whole)."""
    cached = cached or {}
    if snap.decode_streams >= snap.decode_seats:
        return Placement(None, math.inf, reason=(
            f"every decode seat is taken ({snap.decode_streams} streams); add decode replicas or raise "
            "scheduler.max_num_seqs / decode.max_queue"), retry_after_s=1.0)
    replicas = max(snap.decode.live_replicas, 1)
    beside = snap.decode_streams / replicas
    d_work = Work.of(prompt_tokens, cached.get(DECODE, 0))
    d_model = modelled_ttft_s(d_work.tokens, snap.decode, rules, beside_streams=beside, prompt_square=d_work.square)
    local = Placement(DECODE, snap.decode.calibrated(d_model), d_model,
                      local_prefill_s(d_work.tokens, rules, d_work.square), live_replicas=replicas,
                      beside_streams=beside, computed_tokens=d_work.tokens)
    if snap.prefill is None or snap.prefill.live_replicas <= 0:
        return _admit_or_refuse(_with(local, "no_prefill_replica"), snap.decode, snap, rules)
    p_work = Work.of(prompt_tokens, cached.get(PREFILL, 0))
    p_model = modelled_ttft_s(p_work.tokens, snap.prefill, rules, prompt_square=p_work.square)
    remote = Placement(PREFILL, snap.prefill.calibrated(p_model), p_model, reason="prefill_pool",
                       live_replicas=snap.prefill.live_replicas, computed_tokens=p_work.tokens)
    keeps, _why = decode_keeps_tpot(d_work.tokens, snap, rules, d_work.square)
    if keeps and local.predicted_ttft_s < remote.predicted_ttft_s:
        return _admit_or_refuse(_with(local, "earlier_on_decode"), snap.decode, snap, rules)
    return _admit_or_refuse(remote, snap.prefill, snap, rules)


def _with(p: Placement, reason: str) -> Placement:
    return replace(p, reason=reason)


def _admit_or_refuse(choice: Placement, load: PlaceLoad, snap: Snapshot, rules: Rules) -> Placement:
    bound = rules.ttft_slo_s * rules.headroom
    tail = choice.predicted_ttft_s + load.tail_s
    if not rules.shed or not snap.calibrated or load.queued_requests == 0 or tail <= bound:
        return choice
    if load.live_replicas <= 0 or load.backlog_tokens > 0:
        return choice
    if load.fresh_burst and snap.decode_streams < snap.slo_seats and not is_long_prompt(
            choice.computed_tokens, rules.long_prefill_tokens or rules.decode_step_tokens):
        return replace(choice, past_prediction=True)
    excess = tail - bound
    return Placement(None, choice.predicted_ttft_s, choice.modelled_ttft_s, reason=(
        f"predicted time to first token {choice.predicted_ttft_s:.1f} s (+{load.tail_s:.1f} s for the slowest "
        f"twentieth; behind {load.queued_tokens} queued "
        f"prompt tokens on {load.live_replicas} replica(s) of the {choice.pool} pool) is over {rules.headroom:g} x "
        f"the {rules.ttft_slo_s:g} s SLO (admission.ttft_slo_s)"), retry_after_s=max(1.0, math.ceil(excess)))
