"""A benchmark workload: what traffic to send and which SLOs to judge it by.

Workloads are YAML files (``bench/workloads/*.yaml``) validated by the
pydantic models below -- pydantic only at this user boundary; everything
downstream works on the validated objects.

    buckets      request classes with input/output token-length distributions
                 and shares (80% short chat, 15% long document, ...)
    tenants      who sends them; each tenant has one shared system prompt
    arrival      poisson (open loop at a rate), burst (periodic bursts over an
                 optional poisson background), closed (fixed concurrency)
    stop         duration_s and/or num_requests (whichever comes first)
    slos         aggregate targets, e.g. p99 TTFT <= 2 s
    sweep        default levels for ``pdcluster bench --sweep``

A bucket's ``input_tokens`` is the user text; the request's tenant puts its
system prompt in front, so a prompt has system_prompt_tokens + input_tokens
tokens (before any chat template).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

WORKLOAD_DIR = Path(__file__).parent / "workloads"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- length distributions -------------------------------------------------


class Fixed(_Strict):
    dist: Literal["fixed"]
    value: int = Field(ge=1)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


class Uniform(_Strict):
    dist: Literal["uniform"]
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "Uniform":
        if self.max < self.min:
            raise ValueError(f"uniform max {self.max} < min {self.min}: swap them")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.min, self.max + 1, size=n)


class _Clipped(_Strict):
    min: int = Field(1, ge=1)
    max: int = Field(1_000_000, ge=1)

    def _clip(self, x: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(x), self.min, self.max).astype(np.int64)


class Normal(_Clipped):
    dist: Literal["normal"]
    mean: float = Field(gt=0)
    std: float = Field(ge=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self._clip(rng.normal(self.mean, self.std, size=n))


class LogNormal(_Clipped):
    """Long-tailed lengths; ``median`` is exp(mu), ``sigma`` the log-space std."""

    dist: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self._clip(rng.lognormal(np.log(self.median), self.sigma, size=n))


LengthDist = Annotated[Union[Fixed, Uniform, Normal, LogNormal], Field(discriminator="dist")]


# --- traffic --------------------------------------------------------------


class Bucket(_Strict):
    name: str
    share: float = Field(gt=0)
    input_tokens: LengthDist
    output_tokens: LengthDist


class Tenant(_Strict):
    name: str
    share: float = Field(gt=0)
    system_prompt_tokens: int = Field(0, ge=0)


class Poisson(_Strict):
    kind: Literal["poisson"]
    rate_rps: float = Field(gt=0)


class Burst(_Strict):
    """``burst_size`` requests at once every ``period_s``, over an optional
    poisson background of ``background_rps``."""

    kind: Literal["burst"]
    burst_size: int = Field(ge=1)
    period_s: float = Field(gt=0)
    background_rps: float = Field(0.0, ge=0)


class Closed(_Strict):
    kind: Literal["closed"]
    concurrency: int = Field(ge=1)


Arrival = Annotated[Union[Poisson, Burst, Closed], Field(discriminator="kind")]


class Stop(_Strict):
    duration_s: float | None = Field(None, gt=0)
    num_requests: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _some_limit(self) -> "Stop":
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("stop needs duration_s or num_requests (or both): add one")
        return self


class Slo(_Strict):
    """Aggregate target: percentile ``percentile`` of ``metric`` <= ``max_s``.
    Per request, a value above ``max_s`` misses this SLO (goodput)."""

    metric: Literal["ttft", "tpot", "e2e"]
    percentile: float = Field(gt=0, le=100)
    max_s: float = Field(gt=0)


class RequestOptions(_Strict):
    endpoint: Literal["completions", "chat"] = "completions"
    temperature: float = 0.0
    # vLLM-style extension: generate exactly max_tokens.  Servers that do not
    # know it may stop early; bench then counts the tokens actually returned.
    ignore_eos: bool = True
    timeout_s: float = Field(600.0, gt=0)
    priority: int | None = None  # vLLM's extension (lower is more urgent); None: not sent


class Sweep(_Strict):
    kind: Literal["concurrency", "rate"]
    values: list[float] = Field(min_length=1)
    duration_s: float | None = Field(None, gt=0)
    num_requests: int | None = Field(None, ge=1)


class Workload(_Strict):
    name: str
    description: str = ""
    seed: int = 0
    model: str | None = None  # None: ask the server's /v1/models
    buckets: list[Bucket] = Field(min_length=1)
    tenants: list[Tenant] = Field(default_factory=lambda: [Tenant(name="default", share=1.0)])
    arrival: Arrival
    stop: Stop
    slos: list[Slo] = Field(default_factory=list)
    request: RequestOptions = RequestOptions()
    sweep: Sweep | None = None

    @model_validator(mode="after")
    def _unique_names(self) -> "Workload":
        for what, names in (("bucket", [b.name for b in self.buckets]), ("tenant", [t.name for t in self.tenants])):
            if len(set(names)) != len(names):
                raise ValueError(f"{what} names must be unique, got {names}")
        return self


def resolve_workload_path(name_or_path: str) -> Path:
    """A path, or the name of a bundled workload (``mixed`` -> workloads/mixed.yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = WORKLOAD_DIR / f"{path.stem}.yaml"
    if path.suffix in ("", ".yaml") and bundled.is_file() and path.parent == Path("."):
        return bundled
    available = ", ".join(sorted(p.stem for p in WORKLOAD_DIR.glob("*.yaml")))
    raise FileNotFoundError(f"workload {name_or_path!r} not found: give a YAML path or one of: {available}")


def load_workload(name_or_path: str) -> Workload:
    path = resolve_workload_path(name_or_path)
    data = yaml.safe_load(path.read_text())
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{path}: invalid workload:\n{exc}") from exc


def with_overrides(
    workload: Workload,
    *,
    rate_rps: float | None = None,
    concurrency: int | None = None,
    duration_s: float | None = None,
    num_requests: int | None = None,
    seed: int | None = None,
    model: str | None = None,
    endpoint: str | None = None,
) -> Workload:
    """The workload with command-line overrides applied (re-validated)."""
    data = workload.model_dump()
    if rate_rps is not None and concurrency is not None:
        raise ValueError("give --rate or --concurrency, not both")
    if rate_rps is not None:
        data["arrival"] = {"kind": "poisson", "rate_rps": rate_rps}
    if concurrency is not None:
        data["arrival"] = {"kind": "closed", "concurrency": concurrency}
    if duration_s is not None or num_requests is not None:
        data["stop"] = {"duration_s": duration_s, "num_requests": num_requests}
    if seed is not None:
        data["seed"] = seed
    if model is not None:
        data["model"] = model
    if endpoint is not None:
        data["request"]["endpoint"] = endpoint
    return Workload.model_validate(data)
