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
from dataclasses import dataclass, field
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
    # decode at the longest profiled prompt, a burst of each of these batches: the step's cost per token of
    # context (empty: not probed)
    context_batches: tuple[int, ...] = ()
    # the two replicas computing at once (they share the machine): decode gaps while prefills run, prefill
    # time while ``overlap_streams`` sequences decode
    overlap: bool = False
    overlap_streams: int = 2


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
class ContextSample:
    batch: int
    context: float  # mean tokens each sequence held while the gaps were taken
    step_s: float  # median inter-token gap
    gaps: int


@dataclass(frozen=True)
class OverlapSample:
    """Each replica's speed while the other computes, as ratios to its speed alone."""

    decode_alone_s: float  # median gap of one stream, nothing else running
    decode_beside_prefill_s: float  # median gap of one stream while long prompts prefill back to back
    prefill_alone_s: float  # mean TTFT of the longest profiled prompt, nothing else running
    prefill_beside_decode_s: float  # mean TTFT of that prompt while ``streams`` sequences decode
    streams: int
    overhead_s: float  # the TTFT intercept
    short_alone_s: float | None = None  # mean TTFT of the shortest profiled prompt, nothing else running
    short_beside_s: float | None = None  # mean TTFT of that prompt while ``streams`` sequences decode

    @property
    def decode_slowdown(self) -> float:
        return max(self.decode_beside_prefill_s / self.decode_alone_s, 1.0)

    def _prefill_extra(self) -> tuple[float, float]:
        """(delay, slowdown): TTFT beside decoding = alone + delay + (slowdown - 1) x busy.
        Two prompt lengths separate the two; with one, all of it is slowdown.
        Measured with prefill on AMX tiles (2-core Sapphire Rapids): 32 tokens
        0.044 s alone, 0.052 s beside 2 streams; 256 tokens 0.10 s and 0.15 s:
        a delay of ~0 and a slowdown of x1.67 -- the extra time is the busy
        part's, there."""
        busy_long = self.prefill_alone_s - self.overhead_s
        extra_long = self.prefill_beside_decode_s - self.prefill_alone_s
        if self.short_alone_s is None or self.short_beside_s is None:
            return 0.0, ((busy_long + extra_long) / busy_long if busy_long > 0 else 1.0)
        busy_short = self.short_alone_s - self.overhead_s
        extra_short = self.short_beside_s - self.short_alone_s
        if busy_long - busy_short <= 0:
            return max(extra_short, 0.0), 1.0
        slope = max((extra_long - extra_short) / (busy_long - busy_short), 0.0)
        return max(extra_short - slope * max(busy_short, 0.0), 0.0), 1.0 + slope

    @property
    def prefill_slowdown(self) -> float:
        return max(self._prefill_extra()[1], 1.0)

    @property
    def prefill_delay_s(self) -> float:
        """Added to a request's way to the prefill engine while the decode replica computes."""
        return self._prefill_extra()[0]


@dataclass(frozen=True)
class Profile:
    url: str
    model: str
    settings: ProfileSettings
    prefill_samples: list[PrefillSample]
    decode_samples: list[DecodeSample]
    prefill: PrefillModel
    step: StepModel
    context_samples: list[ContextSample] = field(default_factory=list)
    overlap: OverlapSample | None = None


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


    async def context(self, size: int) -> ContextSample:
        """Step time at batch ``size`` with the longest profiled prompts: a
        burst, the gaps while all ``size`` decode."""
        s = self.settings
        prompt = max(s.prompt_lengths)
        burst = await asyncio.gather(*(self.request(prompt, s.decode_tokens) for _ in range(size)))
        gaps = steady_gaps(burst)
        if not gaps:
            raise RuntimeError(f"no inter-token gaps at batch {size}: the server must stream one token per chunk")
        return ContextSample(size, prompt + s.decode_tokens / 2, statistics.median(gaps), len(gaps))

    async def overlap(self, prefill_alone_s: float, overhead_s: float,
                      short_alone_s: float | None = None) -> OverlapSample:
        """One stream decoding while prompts of the longest profiled length
        prefill back to back (its gaps that fall wholly inside a prefill),
        against the same stream alone; then that prompt's TTFT while
        ``overlap_streams`` sequences decode, against its TTFT alone, and the
        shortest profiled prompt's too (``short_alone_s`` given)."""
        s = self.settings
        prompt, tokens = max(s.prompt_lengths), 4 * s.decode_tokens
        alone = await self.request(s.decode_prompt_tokens, tokens)
        spans: list[tuple[float, float]] = []
        done = asyncio.Event()

        async def prefills() -> None:
            while not done.is_set():
                r = await self.request(prompt, 1)
                spans.append((r.start_s + overhead_s, r.start_s + r.ttft_s))

        task = asyncio.create_task(prefills())
        beside = await self.request(s.decode_prompt_tokens, tokens)
        done.set()
        await task
        inside = [b - a for a, b in token_gaps(beside) if any(lo <= a and b <= hi for lo, hi in spans)]
        if not inside:
            raise RuntimeError("no decode gap fell inside a prefill: profile longer prompts (--profile-prompts)")
        streams = [asyncio.create_task(self.request(s.decode_prompt_tokens, 8 * s.decode_tokens))
                   for _ in range(s.overlap_streams)]
        await asyncio.sleep(prefill_alone_s)  # the streams' own prefills are done: they decode now
        ttfts, short = [], []
        for _ in range(s.repeats):
            ttfts.append((await self.request(prompt, 1)).ttft_s)
            if short_alone_s is not None:
                short.append((await self.request(min(s.prompt_lengths), 1)).ttft_s)
        await asyncio.gather(*streams)
        return OverlapSample(statistics.median(alone.itl_s[1:]), statistics.median(inside), prefill_alone_s,
                             statistics.mean(ttfts), s.overlap_streams, overhead_s, short_alone_s,
                             statistics.mean(short) if short else None)


def token_gaps(record: RequestRecord) -> list[tuple[float, float]]:
    """(start, end) of each inter-token gap after the first (the first holds the KV hand-off)."""
    t = record.start_s + record.ttft_s + np.concatenate([[0.0], np.cumsum(record.itl_s)])
    return list(zip(t[1:-1].tolist(), t[2:].tolist()))


async def profile_endpoint(
    url: str, tokenizer: TextTokenizer, settings: ProfileSettings = ProfileSettings(), model: str | None = None,
    show_progress: bool = True,
) -> Profile:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = model or await resolve_model(session, url)
        prober = _Prober(session, url, model, tokenizer, settings)
        steps = (len(settings.prompt_lengths) * settings.repeats + len(settings.batches) + 1
                 + len(settings.context_batches) + settings.overlap)
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
            context_samples = []
            for size in settings.context_batches:
                context_samples.append(await prober.context(size))
                progress.update(task, advance=1, description=f"decode batch {size}, long context")
            prefill = fit_prefill([p.prompt_tokens for p in prefill_samples], [p.ttft_s for p in prefill_samples])
            overlap = None
            if settings.overlap:
                longest = max(p.prompt_tokens for p in prefill_samples)
                alone = statistics.mean(p.ttft_s for p in prefill_samples if p.prompt_tokens == longest)
                shortest = min(p.prompt_tokens for p in prefill_samples)
                short = statistics.mean(p.ttft_s for p in prefill_samples if p.prompt_tokens == shortest)
                overlap = await prober.overlap(alone, prefill.overhead_s, short if shortest < longest else None)
                progress.update(task, advance=1, description="replicas computing at once")
    step = fit_step([d.batch for d in decode_samples], [d.step_s for d in decode_samples])
    return Profile(url, model, settings, prefill_samples, decode_samples, prefill, step, context_samples, overlap)
