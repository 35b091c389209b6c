"""How to pick tokens and when to stop, validated at construction.

Everything a request can ask of the engine thread is bounded here, before it
gets there: a value that would make the sampler divide by zero (or by a
denormal), or make the per-token stop check scan megabytes, is refused with
an error naming the limit and the fix.  What the penalties, ``logit_bias``
and ``min_tokens`` do to the logits is written in penalties.py."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

from pdcluster.services.engine_errors import InvalidRequestError
from pdcluster.services.guided_spec import GuidedSpec

# Caps on what one request may ask the engine thread to check every token:
# the stop strings are scanned after each token, for every running request.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
# Below this, temperature sampling is argmax in every float format we use
# (logits / 1e-300 overflow to inf and softmax turns them into NaN).
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes a signed or unsigned 64-bit integer.
_SEED_RANGE = range(-2**63, 2**64)
# OpenAI's bounds on the penalties and on logit_bias.
PENALTY_RANGE = (-2, 2)                  # presence_penalty, frequency_penalty
LOGIT_BIAS_RANGE = (-100, 100)
MAX_LOGIT_BIAS_ENTRIES = 300
# repetition_penalty divides positive logits and multiplies negative ones;
# inside this window both stay finite in fp32 for any logit a model makes
# (1e4 / 1e-30 is far below fp32's 3.4e38, and 0 * p is never inf * 0).
REPETITION_PENALTY_RANGE = (1e-30, 1e30)
# OpenAI's cap on alternatives per token (top_logprobs, and completions' logprobs).
MAX_LOGPROBS = 20
DEFAULT_TENANT = "default"  # a request of no configured tenant (pdcluster/services/config.py)
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int to Python, not to a client


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """Every error message starts with the field's name (the OpenAI layer
    turns it into the 400's ``param``)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0    # OpenAI: subtracted once from each token already in the output
    frequency_penalty: float = 0.0   # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # vLLM: 1 = off; > 1 discourages tokens of the prompt or output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) by id; a mapping is accepted
    min_tokens: int = 0              # vLLM: EOS and stop_token_ids are masked until this many are out
    priority: int = 0                # vLLM: lower is scheduled first (and preempted last); ties in arrival order
    tenant: str = DEFAULT_TENANT     # whose request: fair shares within a priority (fair_queue.py), KV quotas
    # Log-probabilities (logprobs.py): None = off; k = the chosen token's and the k likeliest alternatives'.
    logprobs: int | None = None          # of each sampled token
    prompt_logprobs: int | None = None   # of each prompt token after the first (echo; skips the prefix cache)
    # Structured output (guided_spec.py): the grammar every output token must follow; None = free text.
    guided: GuidedSpec | None = None
    # Whether the sampler must touch this request's logits row (derived):
    # False lets a batch without penalties skip penalties.py entirely.
    adjusts_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value in validated({f.name: getattr(self, f.name) for f in fields(self) if f.init}).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "adjusts_logits", bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens))

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or so small that sampling is argmax anyway), or top-k 1
        (the same choice, with argmax's tie-break)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def validated(values: dict) -> dict:
    """``values`` (SamplingParams' fields by name) checked, with stop, stop_token_ids and
    logit_bias in their normal form; InvalidRequestError naming the field otherwise.  The
    HTTP layer calls it to refuse a bad value before the prompt is rendered, and builds the
    request's one SamplingParams later (pdcluster/services/openai/routes.py)."""
    v = SimpleNamespace(**values)
    if not _is_int(v.max_tokens) or v.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {v.max_tokens!r}")
    if not _is_real(v.temperature) or v.temperature < 0:
        raise InvalidRequestError(f"temperature must be >= 0 and finite (0 = greedy), got {v.temperature!r}")
    if not _is_real(v.top_p) or not 0 < v.top_p <= 1:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {v.top_p!r}")
    if not _is_int(v.top_k) or v.top_k < 0:
        raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {v.top_k!r}")
    if v.seed is not None and (not _is_int(v.seed) or v.seed not in _SEED_RANGE):
        raise InvalidRequestError(f"seed must be a 64-bit integer or null, got {v.seed!r}")
    v.stop = _checked_stop(v.stop)
    v.stop_token_ids = _checked_stop_token_ids(v.stop_token_ids)
    _check_penalties(v)
    v.logit_bias = _checked_logit_bias(v.logit_bias)
    if not _is_int(v.min_tokens) or not 0 <= v.min_tokens <= v.max_tokens:
        raise InvalidRequestError(f"min_tokens must be an integer from 0 to max_tokens ({v.max_tokens}), "
                                  f"got {v.min_tokens!r}: lower it, or raise max_tokens")
    if not _is_int(v.priority) or abs(v.priority) > 2**31:
        raise InvalidRequestError(f"priority must be an integer of at most 2**31 in size, got {v.priority!r}")
    if not isinstance(v.tenant, str) or not _TENANT_NAME.fullmatch(v.tenant):
        raise InvalidRequestError(f"tenant must be 1 to 64 of A-Z a-z 0-9 _ . -, got {v.tenant!r}")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(v, name)
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            raise InvalidRequestError(f"{name} must be an integer from 0 to {MAX_LOGPROBS} or null, got {k!r}")
    if v.guided is not None and not isinstance(v.guided, GuidedSpec):
        raise InvalidRequestError(f"guided must be a GuidedSpec or None, got {type(v.guided).__name__}")
    return vars(v)


def _check_penalties(v: SimpleNamespace) -> None:
    low, high = PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(v, name)
        if not _is_real(value) or not low <= value <= high:
            raise InvalidRequestError(f"{name} must be between {low:g} and {high:g} (0 = off), got {value!r}")
    low, high = REPETITION_PENALTY_RANGE
    if not _is_real(v.repetition_penalty) or not low <= v.repetition_penalty <= high:
        raise InvalidRequestError(f"repetition_penalty must be between {low:g} and {high:g} (1 = off; "
                                  f"> 1 discourages repeats), got {v.repetition_penalty!r}")


def _checked_stop(stop: object) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r:.200}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"stop has {len(stop)} strings; the limit is {MAX_STOP_STRINGS}: keep the stop strings that matter")
    for s in stop:
        if not s:
            raise InvalidRequestError("stop holds an empty string: drop it (stop strings must be non-empty)")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"stop holds a string of {len(s)} characters; the limit is {MAX_STOP_STRING_CHARS}: shorten it")
    return tuple(stop)


def _checked_stop_token_ids(ids: object) -> tuple[int, ...]:
    if not isinstance(ids, (tuple, list)):
        raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {ids!r:.200}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            f"stop_token_ids has {len(ids)} ids; the limit is {MAX_STOP_TOKEN_IDS}: keep the ids that matter")
    if not all(_is_int(t) and t >= 0 for t in ids):
        raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {ids!r:.200}")
    return tuple(ids)


def _checked_logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` or (id, bias) pairs -> pairs sorted by id, each id once."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
    if not isinstance(pairs, (tuple, list)) or not all(isinstance(e, (tuple, list)) and len(e) == 2 for e in pairs):
        raise InvalidRequestError(f"logit_bias must map token ids to biases, got {bias!r:.200}")
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias has {len(pairs)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}: "
                                  "keep the tokens that matter")
    low, high = LOGIT_BIAS_RANGE
    for token_id, value in pairs:
        if not _is_int(token_id) or token_id < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r:.60}")
        if not _is_real(value) or not low <= value <= high:
            raise InvalidRequestError(
                f"logit_bias of token {token_id} is {value!r}; biases must be between {low:g} and {high:g}")
    out = tuple(sorted((t, float(v)) for t, v in pairs))
    if len({t for t, _ in out}) != len(out):
        raise InvalidRequestError("logit_bias names a token id twice: give each token one bias")
    return out


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def checked_fields(**given) -> dict:
    """``given`` over SamplingParams' defaults, validated as its constructor would
    (``validated``), without building one."""
    return validated({f.name: f.default for f in fields(SamplingParams) if f.init} | given)


@dataclass(frozen=True)
class StreamDraw:
    """What one stream of a request draws with where that differs from its params,
    carried as data beside them (the params are built once per request): choice k > 0
    of n draws with a seed of its own and leaves the prompt's logprobs to choice 0
    (pdcluster/services/openai/choices.py); an unseeded sampled stream gets a seed
    from the gateway, so that a failover replays its draws (gateway/resume.py)."""
    seed: int | None
    prompt_logprobs: int | None

    def __post_init__(self) -> None:
        if self.seed is not None and (not _is_int(self.seed) or self.seed not in _SEED_RANGE):
            raise InvalidRequestError(f"seed must be a 64-bit integer or null, got {self.seed!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"prompt_logprobs must be an integer from 0 to {MAX_LOGPROBS} or null, "
                                      f"got {self.prompt_logprobs!r}")

    @classmethod
    def of(cls, params: SamplingParams) -> "StreamDraw":
        """The draw ``params`` ask for when nothing overrides them."""
        return cls(params.seed, params.prompt_logprobs)
