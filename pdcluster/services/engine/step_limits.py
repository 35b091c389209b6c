"""How many tokens one engine step may take: a pure rule of the scheduler's
config and the replica's state at the step.

    tokens         every token of the step, decode and prompt
    prompt_tokens  of them, prompt tokens (fewer on borrowed cores: the owner gets
                   them back between steps, pools/core_lending.py)
    chunk          prompt tokens of one request

On borrowed cores a step takes ``borrowed_prefill_tokens`` of prompt, or as many
as the replica computes in WIDE_STEP_S by its measured cost a token where that
is more: the 128 tokens were chosen as about 0.3 s on 2 AVX2 threads, and on
AMX they take about 40 ms, a step short enough to cost a third more a token
(a lone 3,072-token prompt: 1.25 s in 128-token steps, 0.95 s in 1,024-token
ones, 2-core Sapphire Rapids).

A replica that decodes (colocated, decode) caps each step's prompt share so its
streams' pause stays short and the prompts queued behind get their turn soon
(``prefill_chunk_size``, ``max_num_batched_tokens``).  With one request on the
replica, a prompt (nothing decodes, nothing waits), neither reason holds, and a
longer step costs less a token where the kernels are fast (2-core Sapphire
Rapids, AMX: a lone 3,072-token prompt 1.0 s in wide steps, 1.1 s in 256-token
ones), so the step may take up to ``wide_step_tokens`` -- as many as the
replica computes in WIDE_STEP_S by its own measured cost a token
(:class:`StepCost`), since a request that arrives meanwhile waits for the step:
on a 2-core AVX2 machine (about 2.3 ms a token) that is fewer than the caps
already allow, and steps stay as they were.  With ``wide_step_tpot_s`` off, not
with several prompts queued: short prompts sharing one wide step all get their
first token at its end, later on average than in narrow steps one after another
(wide steps whenever nothing decoded read a TTFT p99 of 2.01 s against 1.89 s
in mixed_goodput's overload case, one run each, 2026-12-06).

With ``wide_step_tpot_s`` set (the cluster sets the TPOT SLO x headroom on the
replicas that decode), a step also goes wide beside streams that can afford it,
and while nothing decodes (the overload case read a TTFT p99 of 1.84 s in two
runs with it, 2026-12-06).
A stream's TPOT is its mean gap between tokens: (time since its first token +
the steps still to come) / (max_tokens - 1).  Its steps to come each take the
decode rows' time, plus the prompt work queued at the replica that runs beside
them: all of it, or as much as that many steps of the chosen width hold.  How
the queued prompts are cut into steps does not change the total, so a wide step
costs a stream nothing while it lives to see the queue through, and only a
stream near its end limits the width (:func:`widest_step`).  Eight simultaneous
1,024-token prompts of 32 tokens each: the last first token at 1.36 s in
1,024-token steps against 2.02 s in capped ones (2-core Sapphire Rapids).  Prompts
that arrive later are not foreseen (the steps then shrink back to the caps), and
a stream that stops before max_tokens (an EOS, a stop string) may end above the
TPOT: the rule counts on the tokens it was allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdcluster.services.engine.config import SchedulerConfig

WIDE_STEP_S = 0.3      # the longest wide step: what a request arriving meanwhile may wait
MIN_SAMPLE_TOKENS = 64  # steps with fewer tokens say more about fixed costs than about a token's
SMOOTHING = 0.3         # weight of the newest step in the running cost a token


@dataclass(frozen=True)
class Stream:
    """A request past its first token, as its TPOT sees it."""
    decoding_s: float  # since its first token
    tokens: int        # output tokens so far, the first included
    max_tokens: int


def widest_step(streams: list[Stream], tpot_s: float, decode_step_s: float, seconds_per_token: float,
                queued_prompt_tokens: int) -> float:
    """The most tokens a step of the queued prompts may take with every stream still able to
    end within a mean TPOT of ``tpot_s`` (pure; inf where no stream limits it, 0 where one is
    past keeping it whatever the width).  Each step from the next on takes ``decode_step_s``
    for the decode rows plus ``seconds_per_token`` a prompt token it computes (none: no limit)."""
    widest = math.inf
    if not seconds_per_token > 0:
        return widest
    for s in streams:
        gaps = s.max_tokens - 1
        steps = s.max_tokens - s.tokens  # the next one included
        if gaps <= 0 or steps <= 0:
            continue
        left_s = tpot_s * gaps - s.decoding_s - steps * decode_step_s  # for prompt work beside it
        if left_s >= queued_prompt_tokens * seconds_per_token:
            continue  # it sees the whole queue through within its TPOT, however it is cut
        widest = min(widest, max(left_s, 0.0) / (seconds_per_token * steps))
    return widest


@dataclass(frozen=True)
class StepLimits:
    tokens: int
    prompt_tokens: int
    chunk: int


def step_limits(config: SchedulerConfig, borrowing: bool, lone_prompt: bool,
                seconds_per_token: float | None, widest: float | None = None) -> StepLimits:
    """``borrowing``: the step computes on a neighbour's cores; ``lone_prompt``: the
    replica's one request is a prompt still to prefill; ``seconds_per_token``: the
    replica's measured step time a token, None before any (then no wider step);
    ``widest``: the most prompt tokens its streams' TPOT lets a step take
    (:func:`widest_step`; None: the rule is off or nothing measured yet)."""
    measured = seconds_per_token is not None and math.isfinite(seconds_per_token) and seconds_per_token > 0
    # capped before int(): a denormal cost would make the quotient infinite
    timed = int(min(WIDE_STEP_S / seconds_per_token, config.max_num_batched_tokens + config.wide_step_tokens
                    + config.borrowed_prefill_tokens)) if measured else 0
    wide = 0
    if lone_prompt:
        wide = min(config.wide_step_tokens, timed)
    elif widest is not None and widest >= 0:  # NaN and below 0: no wider step
        wide = int(min(config.wide_step_tokens, timed, widest))
    tokens = max(config.max_num_batched_tokens, wide)
    chunk = max(config.prefill_chunk_size, wide)
    prompt = min(tokens, max(config.borrowed_prefill_tokens, timed)) if borrowing else tokens
    return StepLimits(tokens, prompt, chunk)


@dataclass
class StepCost:
    """A replica's running step time a token (exponentially smoothed over steps of
    at least MIN_SAMPLE_TOKENS tokens), as :func:`step_limits` reads it, and its
    decode steps' time (steps without prompt tokens), as :func:`widest_step` reads it."""
    seconds_per_token: float | None = None
    decode_step_s: float | None = None

    def observe(self, tokens: int, seconds: float, prompt_tokens: int = 0) -> None:
        if not (math.isfinite(seconds) and seconds > 0):
            return  # a NaN kept would stick: every later average would be NaN
        if prompt_tokens == 0 and tokens > 0:
            self.decode_step_s = _smoothed(self.decode_step_s, seconds)
        if tokens >= MIN_SAMPLE_TOKENS:
            self.seconds_per_token = _smoothed(self.seconds_per_token, seconds / tokens)


def _smoothed(old: float | None, sample: float) -> float:
    return sample if old is None else old + SMOOTHING * (sample - old)
