"""Prompts made of real vocabulary words of the target tokenizer, with exact
token counts, reproducible from the workload seed.

    prompt (input_tokens) = [ tenant system prompt | user text              ]
                              system_tokens          input_tokens - system_tokens
                              shared by the tenant   unique per request

Every request of a tenant starts with the same system prompt, so a
prefix-caching server can reuse it; the user text is drawn per request from
``(seed, request index)`` and so differs across requests (no accidental
cache hits) yet is the same in every run with the same seed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from bench.load.schedule import RequestPlan
from bench.tokenizer import TextTokenizer
from bench.workload import Workload

_SYSTEM_STREAM, _USER_STREAM = 1, 2
_MAX_FIXUPS = 8


@dataclass(frozen=True)
class Prompt:
    system: str  # "" when the tenant has no system prompt
    user: str
    num_tokens: int  # tokens of system + user under the tokenizer (no chat template)

    @property
    def text(self) -> str:
        return self.system + self.user


def words_text(tokenizer: TextTokenizer, num_tokens: int, rng: np.random.Generator, prefix: str = "") -> tuple[str, int]:
    """Text of random vocabulary words such that ``prefix + text`` encodes to
    ``len(encode(prefix)) + num_tokens`` tokens (exact whenever the tokenizer
    allows; the achieved total is returned).  Whole words are added or dropped
    until the count matches, so the text never ends in a split word."""
    vocab = tokenizer.words()
    base = len(tokenizer.encode(prefix)) if prefix else 0
    target = base + num_tokens
    if num_tokens <= 0:
        return "", base
    pieces = [" " + vocab[i] for i in rng.integers(0, len(vocab), size=num_tokens)]
    count = len(tokenizer.encode(prefix + "".join(pieces)))
    for _ in range(_MAX_FIXUPS):
        if count == target:
            break
        if count < target:
            pieces += [" " + vocab[i] for i in rng.integers(0, len(vocab), size=target - count)]
        else:
            pieces = pieces[: max(1, len(pieces) - (count - target))]
        count = len(tokenizer.encode(prefix + "".join(pieces)))
    return "".join(pieces), count


class PromptBuilder:
    """Builds each request's prompt; tenant system prompts are made once."""

    def __init__(self, workload: Workload, tokenizer: TextTokenizer) -> None:
        self.workload = workload
        self.tokenizer = tokenizer
        self._tenants = {t.name: (i, t.system_prompt_tokens) for i, t in enumerate(workload.tenants)}

    @functools.lru_cache(maxsize=None)
    def system_prompt(self, tenant: str) -> str:
        index, num_tokens = self._tenants[tenant]
        rng = np.random.default_rng([self.workload.seed, _SYSTEM_STREAM, index])
        text, _ = words_text(self.tokenizer, num_tokens, rng)
        return text

    def build(self, plan: RequestPlan) -> Prompt:
        system = self.system_prompt(plan.tenant)
        rng = np.random.default_rng([self.workload.seed, _USER_STREAM, plan.index])
        user, total = words_text(self.tokenizer, plan.input_tokens - plan.system_tokens, rng, prefix=system)
        return Prompt(system=system, user=user, num_tokens=total)
