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
ones), so the step may take up to ``lone_prompt_step_tokens`` -- as many as
the replica computes in WIDE_STEP_S by its own measured cost a token
(:class:`StepCost`), since a request that arrives meanwhile waits for the step:
on a 2-core AVX2 machine (about 2.3 ms a token) that is fewer than the caps
already allow, and steps stay as they were.  Not with several prompts queued:
one wide step gives them all their first token at its end, later on average
than narrow steps one after another, which admission's prediction assumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdcluster.services.engine.config import SchedulerConfig

WIDE_STEP_S = 0.3      # the longest wide step: what a request arriving meanwhile may wait
MIN_SAMPLE_TOKENS = 64  # steps with fewer tokens say more about fixed costs than about a token's
SMOOTHING = 0.3         # weight of the newest step in the running cost a token


@dataclass(frozen=True)
class StepLimits:
    tokens: int
    prompt_tokens: int
    chunk: int


def step_limits(config: SchedulerConfig, borrowing: bool, lone_prompt: bool,
                seconds_per_token: float | None) -> StepLimits:
    """``borrowing``: the step computes on a neighbour's cores; ``lone_prompt``: the
    replica's one request is a prompt still to prefill; ``seconds_per_token``: the
    replica's measured step time a token, None before any (then no wider step)."""
    measured = seconds_per_token is not None and math.isfinite(seconds_per_token) and seconds_per_token > 0
    # capped before int(): a denormal cost would make the quotient infinite
    timed = int(min(WIDE_STEP_S / seconds_per_token, config.max_num_batched_tokens + config.lone_prompt_step_tokens
                    + config.borrowed_prefill_tokens)) if measured else 0
    wide = min(config.lone_prompt_step_tokens, timed) if lone_prompt else 0
    tokens = max(config.max_num_batched_tokens, wide)
    chunk = max(config.prefill_chunk_size, wide)
    prompt = min(tokens, max(config.borrowed_prefill_tokens, timed)) if borrowing else tokens
    return StepLimits(tokens, prompt, chunk)


@dataclass
class StepCost:
    """A replica's running step time a token (exponentially smoothed over steps of
    at least MIN_SAMPLE_TOKENS tokens), as :func:`step_limits` reads it."""
    seconds_per_token: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_SAMPLE_TOKENS or not (math.isfinite(seconds) and seconds > 0):
            return  # a NaN kept would stick: every later average would be NaN
        sample = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = sample if old is None else old + SMOOTHING * (sample - old)
