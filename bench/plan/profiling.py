"""Measures a running endpoint's prefill rate and decode step time vs batch
through its OpenAI API, for ``pdcluster plan --profile URL``.

    prefill   one request at a time, max_tokens=1, prompts of several lengths
              (unique words, so no prefix-cache hits): TTFT vs prompt tokens,
              fitted to overhead + n / rate
    decode    B requests at once, short prompts, ``decode_tokens`` each
              (ignore_eos), then a closed loop of B workers with staggered
              starts: the median inter-token gap of the loop's steady-state
              requests is the step time at batch B (arrivals' prefills
              included, as under load); fitted to a line in B

The first request warms the server up and is not counted.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
from dataclasses import dataclass
from typing import Sequence

import aiohttp
import numpy as np
from rich.console import Console
from rich.progress import Progress

from bench.load.client import RequestRecord, endpoint_url, request_body, send_request
from bench.load.loadgen import resolve_model
from bench.plan.perf_model import PrefillModel, StepModel, fit_prefill, fit_step
from bench.load.prompts import Prompt, words_text
from bench.load.schedule import RequestPlan
from bench.tokenizer import TextTokenizer
from bench.workload import RequestOptions

_PROFILE_STREAM = 3


@dataclass(frozen=True)
class ProfileSettings:
    prompt_lengths: tuple[int, ...] = (128, 256, 512, 1024)
    repeats: int = 2
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    decode_prompt_tokens: int = 32
    decode_tokens: int = 64
    closed_loop_rounds: int = 3  # requests per worker in the steady-state decode probe (< 3: burst only)
    # None: fresh prompts every run; a fixed seed repeats a run's prompts, which
    # a prefix-caching server then answers from cache (prefill looks free)
    seed: int | None = None
    timeout_s: float = 600.0


@dataclass(frozen=True)
class PrefillSample:
    prompt_tokens: int
    ttft_s: float


@dataclass(frozen=True)
class DecodeSample:
    batch: int
    step_s: float  # median inter-token gap while all streams decode
    gaps: int  # how many gaps the median is over


@dataclass(frozen=True)
class Profile:
    url: str
    model: str
    settings: ProfileSettings
    prefill_samples: list[PrefillSample]
    decode_samples: list[DecodeSample]
    prefill: PrefillModel
    step: StepModel


def steady_gaps(records: Sequence[RequestRecord]) -> list[float]:
    """Inter-token gaps that fall where every stream had started and none had
    finished (all B sequences in the batch); all gaps after each stream's
    first quarter if that window is empty."""
    token_times = []
    for r in records:
        if r.ttft_s is not None and r.itl_s:
            first = r.start_s + r.ttft_s
            token_times.append(first + np.concatenate([[0.0], np.cumsum(r.itl_s)]))
    if not token_times:
        return []
    lo, hi = max(t[0] for t in token_times), min(t[-1] for t in token_times)
    gaps = [float(b - a) for t in token_times for a, b in zip(t[:-1], t[1:]) if a >= lo and b <= hi]
    if len(gaps) >= 4:
        return gaps
    return [gap for t in token_times for gap in np.diff(t)[len(t) // 4:].tolist()]


class _Prober:
    def __init__(self, session, url: str, model: str, tokenizer: TextTokenizer, settings: ProfileSettings) -> None:
        self.session, self.model, self.tokenizer, self.settings = session, model, tokenizer, settings
        self.options = RequestOptions(endpoint="completions", ignore_eos=True, timeout_s=settings.timeout_s)
        self.url = endpoint_url(url, self.options)
        self.count = 0
        self.seed = settings.seed if settings.seed is not None else secrets.randbits(32)

    async def request(self, prompt_tokens: int, max_tokens: int) -> RequestRecord:
        self.count += 1
        rng = np.random.default_rng([self.seed, _PROFILE_STREAM, self.count])
        text, n = words_text(self.tokenizer, prompt_tokens, rng)
        body = request_body(self.options, self.model, Prompt("", text, n), max_tokens)
        plan = RequestPlan(self.count, "profile", "profile", n, 0, max_tokens, None)
        record = await send_request(self.session, self.url, body, plan, n, 0.0, self.settings.timeout_s)
        if not record.ok:
            raise RuntimeError(f"profile request failed ({record.error}: {record.error_detail}); is the server healthy?")
        return record

    async def batch(self, size: int) -> DecodeSample:
        """Step time at batch ``size`` as a closed loop sees it: a burst of
        ``size`` streams first estimates a request's lifetime; then ``size``
        workers, their starts spread over one lifetime, each run requests
        back to back, so arrivals (and their prefills) keep interleaving with
        decoding as under real load.  The median inter-token gap of the
        workers' middle requests is the step time."""
        s = self.settings
        burst = await asyncio.gather(*(self.request(s.decode_prompt_tokens, s.decode_tokens) for _ in range(size)))
        gaps = steady_gaps(burst)
        if not gaps:
            raise RuntimeError(f"no inter-token gaps at batch {size}: the server must stream one token per chunk")
        if size == 1 or s.closed_loop_rounds < 3:
            return DecodeSample(size, statistics.median(gaps), len(gaps))
        lifetime = statistics.median(r.e2e_s for r in burst)

        async def worker(i: int) -> list[RequestRecord]:
            await asyncio.sleep(i * lifetime / size)
            return [await self.request(s.decode_prompt_tokens, s.decode_tokens) for _ in range(s.closed_loop_rounds)]

        runs = await asyncio.gather(*(worker(i) for i in range(size)))
        middle = [gap for recs in runs for r in recs[1:-1] for gap in r.itl_s[1:]]
        return DecodeSample(size, statistics.median(middle), len(middle))


async def profile_endpoint(
    url: str, tokenizer: TextTokenizer, settings: ProfileSettings = ProfileSettings(), model: str | None = None,
    show_progress: bool = True,
) -> Profile:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = model or await resolve_model(session, url)
        prober = _Prober(session, url, model, tokenizer, settings)
        steps = len(settings.prompt_lengths) * settings.repeats + len(settings.batches) + 1
        with Progress(console=Console(stderr=True), disable=not show_progress) as progress:
            task = progress.add_task("profiling", total=steps)
            await prober.request(settings.decode_prompt_tokens, 4)  # warm-up
            progress.advance(task)
            prefill_samples = []
            for length in settings.prompt_lengths:
                for _ in range(settings.repeats):
                    record = await prober.request(length, 1)
                    prefill_samples.append(PrefillSample(record.input_tokens, record.ttft_s))
                    progress.update(task, advance=1, description=f"prefill {length} tokens")
            decode_samples = []
            for size in settings.batches:
                decode_samples.append(await prober.batch(size))
                progress.update(task, advance=1, description=f"decode batch {size}")
    prefill = fit_prefill([p.prompt_tokens for p in prefill_samples], [p.ttft_s for p in prefill_samples])
    step = fit_step([d.batch for d in decode_samples], [d.step_s for d in decode_samples])
    return Profile(url, model, settings, prefill_samples, decode_samples, prefill, step)
