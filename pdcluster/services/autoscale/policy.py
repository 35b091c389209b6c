"""How many replicas each pool should have: a pure function of live
measurements, the planner's speed model (pdcluster/planning/speed.py) and the
previous decision's state.  No I/O, no clock: ``now_s`` comes in with the
measurements, so every scenario replays exactly in a unit test.

The need, per pool (prefill and decode are sized separately):

    prefill   S       = prefill(prompt_mean)                       seconds a request spends in prefill
              busy    = S - overhead                               seconds it occupies a replica
              a       = arrival_rps x busy                         offered load, in busy replicas
              rho(n)  = a / n
              wait(n) = max(rho / (1 - rho) x busy / 2,            M/D/1 queueing per replica
                            queued_tokens x per_token / n)         the backlog the gateway holds now, drained
              need    = smallest n with rho(n) <= max_utilization
                                    and S + wait(n) <= ttft_slo x headroom
    prefill   share   = arrival_rps x busy / decode replicas       the fraction of each decode replica's time
    at zero                                                         its prompts would take if it prefilled them
              (prefill min_replicas 0) need = 0 while share <= local_prefill_max_share, S <= the TTFT
              budget, and the decode replicas at their calibrated speed x (1 - share) still stream the
              demand: at low load one replica serving both phases beats two, and the decode replicas
              prefill locally (the gateway routes them there while the pool's target is 0); else the
              pool's need as above (it comes back, as any up-scale)
    decode    slow    = measured mean TPOT / step(sequences / replicas)   the model calibrated live (in
                        [0.5, 4]): contention, a busier machine; from a window with at least
                        calibration_samples finished requests, else the last such window's (kept
                        across windows and scale changes: a quiet spell or a cleared window does not
                        make the machine fast again), 1 until there was one
              step'(B)= slow x step(B)
              B*      = largest batch with step'(B) <= tpot_slo x headroom     (>= 1, <= max_num_seqs)
              demand  = max(output tok/s streamed, arrival_rps x output tokens per request): an
                        overloaded pool streams only what it can
              need    = max(ceil(demand / (B* / step'(B*)) / max_utilization),   throughput at B*
                            ceil(sequences / B*))                   Little: L = rps x W, observed directly
              with the prefill pool at zero and slow = 1 (not calibrated yet), each replica's tokens/s
              is x (1 - share): its prompts take that share of its time (a calibrated slow already
              holds the stalls they cause, so it is not counted twice)
    order     prefill is decided first, on the decode pool as it is, then decode on whether the
              prefill pool will be at zero; both may grow in one tick
    SLO guard the pool's p90 (TTFT for prefill, TPOT for decode) over the SLO, with at least
              min_latency_samples behind it, while the need says "enough": need = replicas + 1
    futile    decode: the last change was an up-scale, the steps are slower than the model now than
              when it was decided (slow now > slow then), and the model alone (slow = 1) says the
              replicas suffice: the added replica made every step slower, not the pool faster -- the
              replicas share cores that are already full (another process, or more replicas than
              cores) -- so another one would too: hold until the slowdown falls back

Then, per pool, the hysteresis that keeps it from oscillating:

    up     need > replicas, and up_cooldown_s since the last change     -> min(need, max_replicas)
    down   the need at demand x down_margin (the band) stays below replicas
           for down_stable_s, and down_cooldown_s since the last change -> max(that need, min_replicas)
    hold   otherwise; a reason says which rule held it

An up-scale acts on one window's figures (a missed SLO costs more than a
replica); a down-scale needs the margin *and* a stable spell, so noise
around a boundary never reverses a decision within a cool-down."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

POOLS = ("prefill", "decode")
_MAX_SEARCH = 64  # replicas the prefill search tries before it gives up


class PrefillSpeed(Protocol):
    overhead_s: float

    def time_s(self, tokens: float) -> float: ...


class StepSpeed(Protocol):
    def step_s(self, batch: float) -> float: ...

    def max_batch_within(self, tpot_s: float) -> int: ...


@dataclass(frozen=True)
class ScalingRules:
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    headroom: float = 0.7  # plan for this fraction of each SLO: the margin for noise and start-up lag
    max_utilization: float = 0.8  # busy fraction a replica may be planned at (queueing blows up near 1)
    max_num_seqs: int = 64
    local_prefill_max_share: float = 0.2  # prefill pool at zero while prompts take at most this of a decode replica
    down_margin: float = 1.3  # a scale-down must still fit demand x this
    up_cooldown_s: float = 10.0
    down_cooldown_s: float = 30.0
    down_stable_s: float = 20.0
    min_latency_samples: int = 8  # behind a p90 that may force a scale-up
    calibration_samples: int = 4  # behind the mean TPOT that calibrates the step model
    bounds: tuple[tuple[int, int], tuple[int, int]] = ((1, 2), (1, 4))  # (min, max) for prefill, decode

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tpot_slo_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"autoscaling.{name} must be > 0, got {getattr(self, name)}")
        for name in ("headroom", "max_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"autoscaling.{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.local_prefill_max_share < 1:
            raise ValueError(f"autoscaling.local_prefill_max_share must be in [0, 1), got "
                             f"{self.local_prefill_max_share}")
        if self.down_margin < 1:
            raise ValueError(f"autoscaling.down_margin must be >= 1 (the hysteresis band), got {self.down_margin}")
        for pool, (lo, hi) in zip(POOLS, self.bounds):
            least = 0 if pool == "prefill" else 1  # the decode pool serves every stream; prefill can hand its work over
            if not least <= lo <= hi or hi < 1:
                raise ValueError(f"autoscaling.{pool}: need {least} <= min_replicas <= max_replicas, max_replicas "
                                 f">= 1, got {lo}..{hi}")

    def bound(self, pool: str) -> tuple[int, int]:
        return self.bounds[POOLS.index(pool)]


@dataclass(frozen=True)
class PoolMeasurement:
    """One pool over the last window.  ``latency_p90_s``: TTFT for prefill,
    TPOT for decode (None: no request finished in the window)."""

    queued_tokens: float = 0.0  # prompt tokens admitted and awaiting a first token (prefill)
    sequences: float = 0.0  # running + waiting sequences, window mean (decode)
    latency_p90_s: float | None = None
    latency_samples: int = 0
    latency_mean_s: float | None = None
    replicas: int = 0  # replicas reporting on the status board


@dataclass(frozen=True)
class Measurements:
    now_s: float
    arrival_rps: float
    prompt_tokens_mean: float
    output_tok_s: float  # tokens the decode pool generated per second
    prefill: PoolMeasurement = PoolMeasurement()
    decode: PoolMeasurement = PoolMeasurement()
    output_tokens_mean: float = 0.0  # tokens per answered request (0: not known yet)

    def pool(self, name: str) -> PoolMeasurement:
        return self.prefill if name == "prefill" else self.decode

    @property
    def output_demand_tok_s(self) -> float:
        """Tokens/s the arrivals ask for: what was generated, or arrivals x
        tokens per request when that is more -- an overloaded pool generates
        only what it can, so its output lags the demand it should be sized for."""
        return max(self.output_tok_s, self.arrival_rps * self.output_tokens_mean)


@dataclass(frozen=True)
class PoolState:
    replicas: int
    last_change_s: float = -math.inf
    below_since_s: float | None = None  # since when the banded need has stayed below ``replicas``
    up_slowdown: float | None = None  # decode: the measured slowdown the last change (an up-scale) was decided on
    slowdown: float | None = None  # decode: the last calibrated slowdown (None: never calibrated)


@dataclass(frozen=True)
class Need:
    replicas: int
    why: str


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    current: int
    target: int
    need: int  # before bounds and hysteresis
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down" if self.target < self.current else "hold"


# --- the need -------------------------------------------------------------


def local_prefill_share(arrival_rps: float, prompt_mean: float, speed: PrefillSpeed, decode_replicas: int) -> float:
    """The fraction of each decode replica's time its prompts take when it prefills them itself."""
    busy_s = max(speed.time_s(prompt_mean) - speed.overhead_s, 0.0)
    return arrival_rps * busy_s / max(decode_replicas, 1)


def prefill_need(arrival_rps: float, prompt_mean: float, queued_tokens: float, speed: PrefillSpeed,
                 rules: ScalingRules, demand_scale: float = 1.0, decode_replicas: int | None = None) -> Need:
    """``decode_replicas``: given when the pool may go to zero (min_replicas 0), the decode pool's size."""
    service_s = speed.time_s(prompt_mean)
    busy_s = max(service_s - speed.overhead_s, 1e-9)
    per_token_s = busy_s / max(prompt_mean, 1.0)
    offered = arrival_rps * demand_scale * busy_s
    budget_s = rules.ttft_slo_s * rules.headroom
    if decode_replicas is not None:
        share = local_prefill_share(arrival_rps * demand_scale, prompt_mean, speed, decode_replicas)
        if share <= rules.local_prefill_max_share and service_s <= budget_s:
            return Need(0, f"prefill on the {decode_replicas} decode replica(s): {arrival_rps * demand_scale:.2f} "
                           f"req/s x {busy_s:.2f} s busy / {decode_replicas} = {share:.2f} of each <= "
                           f"{rules.local_prefill_max_share:g}")
    for n in range(1, _MAX_SEARCH + 1):
        rho = offered / n
        if rho > rules.max_utilization:
            continue
        wait_s = max(rho / (1 - rho) * busy_s / 2, queued_tokens * demand_scale * per_token_s / n)
        if service_s + wait_s <= budget_s:
            return Need(n, f"{arrival_rps * demand_scale:.2f} req/s x {busy_s:.2f} s busy = {offered:.2f} replicas "
                           f"busy; at {n}: rho {rho:.2f}, TTFT {service_s:.2f} + wait {wait_s:.2f} s <= "
                           f"{budget_s:.2f} s")
    return Need(_MAX_SEARCH, f"{offered:.2f} replicas busy: no count up to {_MAX_SEARCH} predicts TTFT <= "
                             f"{budget_s:.2f} s (a prompt of {prompt_mean:.0f} tokens alone takes {service_s:.2f} s)")


_SLOWDOWN_BOUNDS = (0.5, 4.0)


@dataclass(frozen=True)
class Calibrated:
    """A step model scaled by what the pool measures: ``factor`` x step(B).
    The whole line, not only its fixed part: that is pessimistic at larger
    batches, and on the 2-core CI machine it is what met the SLO -- the
    steps of a decode replica that prefills slow down with the arrival rate
    (each prompt stalls them), which a factor measured at low load does not
    hold; a factor on the fixed part alone sized a replica that missed it."""

    step: StepSpeed
    factor: float

    def step_s(self, batch: float) -> float:
        return self.factor * self.step.step_s(batch)

    def max_batch_within(self, tpot_s: float) -> int:
        return self.step.max_batch_within(tpot_s / self.factor)


def measured_slowdown(p: PoolMeasurement, speed: StepSpeed, rules: ScalingRules) -> float | None:
    """Measured mean TPOT over the model's step at the batch each replica ran;
    None when the window has too few finished requests to say."""
    if p.latency_mean_s is None or p.latency_samples < rules.calibration_samples or p.replicas < 1:
        return None
    ratio = p.latency_mean_s / speed.step_s(max(1.0, p.sequences / p.replicas))
    return min(max(ratio, _SLOWDOWN_BOUNDS[0]), _SLOWDOWN_BOUNDS[1])


def decode_slowdown(p: PoolMeasurement, speed: StepSpeed, rules: ScalingRules,
                    remembered: float | None = None) -> float:
    """This window's slowdown, else the last calibrated one, else 1 (the model as it is)."""
    measured = measured_slowdown(p, speed, rules)
    return measured if measured is not None else remembered if remembered is not None else 1.0


def decode_batch(speed: StepSpeed, rules: ScalingRules) -> int:
    return max(1, min(rules.max_num_seqs, speed.max_batch_within(rules.tpot_slo_s * rules.headroom)))


def decode_need(output_tok_s: float, sequences: float, speed: StepSpeed, rules: ScalingRules,
                demand_scale: float = 1.0, prefill_share: float = 0.0) -> Need:
    """``prefill_share``: the fraction of a replica's time its own prompts take (prefill pool at zero)."""
    batch = decode_batch(speed, rules)
    per_replica_tok_s = batch / speed.step_s(batch) * (1.0 - min(prefill_share, 0.9))
    by_throughput = output_tok_s * demand_scale / (per_replica_tok_s * rules.max_utilization)
    by_little = sequences * demand_scale / batch
    n = max(1, math.ceil(by_throughput - 1e-9), math.ceil(by_little - 1e-9))
    local = f" less {prefill_share:.2f} for its prompts" if prefill_share else ""
    return Need(n, f"{output_tok_s * demand_scale:.0f} tok/s / ({per_replica_tok_s:.0f} tok/s at B* {batch}{local} x "
                   f"{rules.max_utilization:g}) = {by_throughput:.2f}; {sequences * demand_scale:.1f} sequences / "
                   f"B* {batch} = {by_little:.2f}")


@dataclass(frozen=True)
class Pools:
    """What one pool's need depends on of the other: the decode pool's size
    (for a prefill pool that may go to zero), whether the prefill pool is at zero."""

    decode_replicas: int = 1
    prefill_at_zero: bool = False
    slowdown: float | None = None  # the decode steps' calibrated factor; None: from the measurements alone

    def decode_slowdown(self, m: Measurements, step: StepSpeed, rules: ScalingRules) -> float:
        """The factor given here, else the window's (:func:`decode_slowdown`)."""
        return self.slowdown if self.slowdown is not None else decode_slowdown(m.decode, step, rules)


def pool_need(pool: str, m: Measurements, prefill: PrefillSpeed, step: StepSpeed, rules: ScalingRules,
              demand_scale: float = 1.0, pools: Pools = Pools()) -> Need:
    if pool == "prefill":
        if rules.bound("prefill")[0] != 0:
            return prefill_need(m.arrival_rps, m.prompt_tokens_mean, m.prefill.queued_tokens, prefill, rules,
                                demand_scale)
        return _prefill_need_may_vanish(m, prefill, step, rules, demand_scale, pools)
    slowdown = pools.decode_slowdown(m, step, rules)
    share = 0.0
    if pools.prefill_at_zero and slowdown == 1.0:  # a calibrated slowdown already holds the prompts' stalls
        share = local_prefill_share(m.arrival_rps * demand_scale, m.prompt_tokens_mean, prefill,
                                    max(pools.decode_replicas, 1))
    need = decode_need(m.output_demand_tok_s, m.decode.sequences, Calibrated(step, slowdown), rules, demand_scale,
                       share)
    return need if slowdown == 1.0 else Need(need.replicas, f"{need.why}; steps x{slowdown:.2f} as measured")


def _prefill_need_may_vanish(m: Measurements, prefill: PrefillSpeed, step: StepSpeed, rules: ScalingRules,
                             demand_scale: float, pools: Pools) -> Need:
    """Zero while the share allows it *and* the decode replicas, at their
    calibrated speed less the prompts' share, still stream the demand: a
    decode replica's steps stall for every prompt it prefills, so on a
    machine where they are already near the TPOT budget the pool stays."""
    need = prefill_need(m.arrival_rps, m.prompt_tokens_mean, m.prefill.queued_tokens, prefill, rules, demand_scale,
                        pools.decode_replicas)
    if need.replicas != 0:
        return need
    slowdown = pools.decode_slowdown(m, step, rules)
    share = local_prefill_share(m.arrival_rps * demand_scale, m.prompt_tokens_mean, prefill, pools.decode_replicas)
    local = decode_need(m.output_demand_tok_s, m.decode.sequences, Calibrated(step, slowdown), rules, demand_scale,
                        share)
    if local.replicas <= pools.decode_replicas:
        return need
    back = prefill_need(m.arrival_rps, m.prompt_tokens_mean, m.prefill.queued_tokens, prefill, rules, demand_scale)
    return Need(back.replicas, f"{back.why}; at zero the {pools.decode_replicas} decode replica(s) would need "
                               f"{local.replicas} to prefill too ({local.why}; steps x{slowdown:.2f})")


def steady_need(m: Measurements, prefill: PrefillSpeed, step: StepSpeed, rules: ScalingRules) -> tuple[int, int]:
    """(prefill, decode) replicas the rule settles on for ``m`` held steady,
    within the bounds: the two needs depend on each other (a prefill pool at
    zero loads the decode replicas; their number sets the prefill share), so
    they are iterated to a fixed point (a few rounds: each only grows decode)."""
    (p_lo, p_hi), (d_lo, d_hi) = rules.bounds
    decode = min(max(pool_need("decode", m, prefill, step, rules).replicas, d_lo), d_hi)
    for _ in range(8):
        p = min(max(pool_need("prefill", m, prefill, step, rules, pools=Pools(decode_replicas=decode)).replicas,
                    p_lo), p_hi)
        d = min(max(pool_need("decode", m, prefill, step, rules,
                              pools=Pools(decode_replicas=decode, prefill_at_zero=p == 0)).replicas, d_lo), d_hi)
        if d == decode:
            return p, d
        decode = d
    return p, decode


def futile_up_scale(pool: str, m: Measurements, state: PoolState, step: StepSpeed, rules: ScalingRules,
                    slowdown: float) -> str | None:
    """Why another decode replica would not help (the rule's "futile" line), or None."""
    if pool != "decode" or state.up_slowdown is None:
        return None
    if slowdown <= state.up_slowdown:
        return None
    nominal = decode_need(m.output_demand_tok_s, m.decode.sequences, step, rules).replicas
    if nominal > state.replicas:
        return None
    return (f"the last up-scale made steps slower (x{state.up_slowdown:.2f} the model when decided, x{slowdown:.2f} "
            f"now) and the model alone needs {nominal}: the replicas share full cores, another would not help")


def slo_breach(pool: str, p: PoolMeasurement, rules: ScalingRules) -> str | None:
    slo, metric = (rules.ttft_slo_s, "TTFT") if pool == "prefill" else (rules.tpot_slo_s, "TPOT")
    if p.latency_p90_s is None or p.latency_samples < rules.min_latency_samples or p.latency_p90_s <= slo:
        return None
    return f"{metric} p90 {p.latency_p90_s:.3f} s > SLO {slo:g} s over {p.latency_samples} requests"


# --- hysteresis -------------------------------------------------------------


def decide_pool(pool: str, m: Measurements, state: PoolState, prefill: PrefillSpeed, step: StepSpeed,
                rules: ScalingRules, pools: Pools = Pools()) -> tuple[PoolDecision, PoolState]:
    lo, hi = rules.bound(pool)
    now, current = m.now_s, state.replicas
    slowdown = pools.decode_slowdown(m, step, rules)
    need = pool_need(pool, m, prefill, step, rules, pools=pools)
    wanted, why = need.replicas, need.why
    breach = slo_breach(pool, m.pool(pool), rules)
    if breach and wanted <= current:
        wanted, why = current + 1, f"{breach} (the model said {need.replicas} suffice)"

    def out(target: int, reason: str, below_since: float | None) -> tuple[PoolDecision, PoolState]:
        changed = target != current
        if target > current:
            up_slowdown = slowdown if pool == "decode" else None
        else:
            up_slowdown = None if changed else state.up_slowdown
        new_state = PoolState(target, now if changed else state.last_change_s, None if changed else below_since,
                              up_slowdown, state.slowdown)
        return PoolDecision(pool, current, target, need.replicas, reason), new_state

    if current < lo or current > hi:
        target = min(max(current, lo), hi)
        return out(target, f"outside min/max {lo}..{hi}", None)
    since_change = now - state.last_change_s
    if wanted > current:
        if current == hi:
            return out(current, f"at max_replicas {hi}; wanted {wanted}: {why}", None)
        futile = futile_up_scale(pool, m, state, step, rules, slowdown)
        if futile:
            return out(current, f"wanted {wanted}, held: {futile}", None)
        if since_change < rules.up_cooldown_s:
            return out(current, f"up-scale cooling down ({since_change:.0f} of {rules.up_cooldown_s:g} s); "
                                f"wanted {wanted}: {why}", None)
        return out(min(wanted, hi), f"wanted {wanted}: {why}", None)
    banded = pool_need(pool, m, prefill, step, rules, rules.down_margin, pools).replicas
    if breach or banded >= current or current == lo:
        held = "at min_replicas" if current == lo and banded <= current else "within the band"
        return out(current, f"{held}: need {need.replicas}, x{rules.down_margin:g} demand needs {banded}", None)
    below_since = state.below_since_s if state.below_since_s is not None else now
    if now - below_since < rules.down_stable_s:
        return out(current, f"down-scale waiting for a stable spell ({now - below_since:.0f} of "
                            f"{rules.down_stable_s:g} s); x{rules.down_margin:g} demand needs {banded}", below_since)
    if since_change < rules.down_cooldown_s:
        return out(current, f"down-scale cooling down ({since_change:.0f} of {rules.down_cooldown_s:g} s)",
                   below_since)
    target = max(banded, lo)
    return out(target, f"x{rules.down_margin:g} demand needs {banded} for {now - below_since:.0f} s: {why}", None)


@dataclass(frozen=True)
class ScalerState:
    prefill: PoolState
    decode: PoolState

    def pool(self, name: str) -> PoolState:
        return getattr(self, name)

    def changed_at(self, pool: str, now_s: float) -> ScalerState:
        """Cool-downs count from when the change is live (the controller's redeploy has returned)."""
        return replace(self, **{pool: replace(self.pool(pool), last_change_s=now_s)})

    def with_replicas(self, pool: str, replicas: int) -> ScalerState:
        """The controller's view after something else (``pdcluster scale``) resized a pool."""
        return replace(self, **{pool: replace(self.pool(pool), replicas=replicas, below_since_s=None)})


def decide(m: Measurements, state: ScalerState, prefill: PrefillSpeed, step: StepSpeed,
           rules: ScalingRules) -> tuple[list[PoolDecision], ScalerState]:
    """One decision per pool and the state the next call takes: prefill
    first, on the decode pool as it is; decode on whether the prefill pool
    will be at zero.  Both may grow in one tick: at a peak's onset, holding
    decode back until the prefill pool was up cost a whole redeploy plus a
    calibration window of the peak (2-core CI machine: decode 28 s after the
    prefill pool, goodput 0.75 in a peak a 1 + 2 deployment served at 1.00)."""
    measured = measured_slowdown(m.decode, step, rules)
    remembered = measured if measured is not None else state.decode.slowdown
    slowdown = remembered if remembered is not None else 1.0
    p, p_state = decide_pool("prefill", m, state.prefill, prefill, step, rules,
                             Pools(decode_replicas=state.decode.replicas, slowdown=slowdown))
    d, d_state = decide_pool("decode", m, replace(state.decode, slowdown=remembered), prefill, step, rules,
                             Pools(decode_replicas=state.decode.replicas, prefill_at_zero=p.target == 0,
                                   slowdown=slowdown))
    return [p, d], ScalerState(p_state, d_state)
