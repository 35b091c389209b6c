"""Measures a running endpoint's prefill rate and decode step time vs batch
through its OpenAI API, for ``pdcluster plan --profile URL``.

    prefill   one request at a time, ``prefill_max_tokens`` each (they go on
              to decode, as served requests do), prompts of several lengths
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
from bench.load.prompts import Prompt, words_text
from bench.load.schedule import RequestPlan
from bench.plan.predict import way_in
from bench.tokenizer import TextTokenizer
from bench.workload import RequestOptions
from pdcluster.planning.speed import PrefillModel, StepModel, fit_prefill, fit_step

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
    # max_tokens of the prefill probes (alone and beside decoding), sent one after another: each goes on to
    # decode, as served requests do, so the next prefill follows decoding.  Measured (AMX machine, 64-token
    # prompts, one-token requests): TTFT 52.6 ms right after another prefill, 57.1 ms after a second idle,
    # 64.4 ms right after a 48-token request decoded (medians of 6); one-token probes back to back put chat c1's
    # TTFT at 0.05-0.06 s where it measured 0.07 s
    prefill_max_tokens: int = 32


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
class PrefillBeside:
    """One profiled prompt length's TTFT alone and while the decode replica computes."""

    prompt_tokens: int
    alone_s: float  # median TTFT, nothing else running (the profile's prefill samples)
    beside_s: float  # median TTFT while ``streams`` sequences decode
    samples: tuple[float, ...] = ()  # every TTFT beside decoding the median is over


def ttft_jitter(points: Sequence[PrefillBeside]) -> float:
    """The pooled standard deviation of TTFT about each length's mean beside
    decoding: how far two alike requests' times differ under load (0 with
    fewer than two samples of any length)."""
    squares, freedom = 0.0, 0
    for p in points:
        if len(p.samples) >= 2:
            mean = statistics.mean(p.samples)
            squares += sum((x - mean) ** 2 for x in p.samples)
            freedom += len(p.samples) - 1
    return (squares / freedom) ** 0.5 if freedom else 0.0


def split_prefill_extra(points: Sequence[PrefillBeside], overhead_s: float) -> tuple[float, float]:
    """(delay, slowdown) from TTFT beside decoding = alone + delay +
    (slowdown - 1) x busy, busy = alone - ``overhead_s`` (the way in: what
    is left is the prefill engine's time): the least-squares line through
    (busy, extra) with delay >= 0 and slowdown >= 1.  One length cannot
    separate the two: all of it is slowdown.  Measured with prefill on AMX
    tiles (2-core Sapphire Rapids, one stream decoding), TTFT beside decoding
    over alone: 32 tokens +15 ms, 128 +28 ms, 256 +40 ms, 512 +55-83 ms; two
    samples of two lengths put the slowdown anywhere from x1.1 to x1.67, so
    every length counts, each a median."""
    xs = [p.alone_s - overhead_s for p in points]
    ys = [p.beside_s - p.alone_s for p in points]
    if not xs:
        return 0.0, 1.0

    def sse(delay: float, slope: float) -> float:
        return sum((y - delay - slope * x) ** 2 for x, y in zip(xs, ys))

    sxx = sum(x * x for x in xs)
    candidates = [(0.0, max(sum(x * y for x, y in zip(xs, ys)) / sxx, 0.0) if sxx > 0 else 0.0),
                  (max(statistics.mean(ys), 0.0), 0.0)]  # on a tie (one length) the first, all slowdown, wins
    n, mx = len(xs), statistics.mean(xs)
    var = sum((x - mx) ** 2 for x in xs)
    if n >= 2 and var > 0:
        slope = sum((x - mx) * (y - statistics.mean(ys)) for x, y in zip(xs, ys)) / var
        delay = statistics.mean(ys) - slope * mx
        if slope >= 0 and delay >= 0:
            candidates.insert(0, (delay, slope))
    delay, slope = min(candidates, key=lambda c: sse(*c))
    return delay, 1.0 + slope


@dataclass(frozen=True)
class OverlapSample:
    """Each replica's speed while the other computes, as ratios to its speed alone."""

    decode_alone_s: float  # median gap of one stream, nothing else running
    decode_beside_prefill_s: float  # median gap of one stream while long prompts prefill back to back
    streams: int
    overhead_s: float  # send to reaching the prefill engine (bench/plan/predict.py way_in)
    prefill: tuple[PrefillBeside, ...] = ()  # every profiled length, alone and beside ``streams`` decoding

    @property
    def decode_slowdown(self) -> float:
        return max(self.decode_beside_prefill_s / self.decode_alone_s, 1.0)

    @property
    def prefill_slowdown(self) -> float:
        return split_prefill_extra(self.prefill, self.overhead_s)[1]

    @property
    def prefill_delay_s(self) -> float:
        """Added to a request's way to the prefill engine while the decode replica computes."""
        return split_prefill_extra(self.prefill, self.overhead_s)[0]

    @property
    def jitter_s(self) -> float:
        return ttft_jitter(self.prefill)


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

    async def overlap(self, alone: dict[int, float], overhead_s: float) -> OverlapSample:
        """One stream decoding while prompts of the longest profiled length
        prefill back to back (its gaps that fall wholly inside a prefill),
        against the same stream alone; then every profiled length's TTFT
        (``alone``: length -> median TTFT alone), ``max(repeats, 4)`` times
        each, while ``overlap_streams`` sequences decode.  Only prefills that
        ended before the first stream did count."""
        s = self.settings
        prompt, tokens = max(alone), 4 * s.decode_tokens
        first = await self.request(s.decode_prompt_tokens, tokens)
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
        gap = statistics.median(first.itl_s[1:])
        repeats = max(s.repeats, 4)
        # long enough to outlast every probe (its prefill and decode) at half again its pace alone
        probes_s = repeats * sum(t + (s.prefill_max_tokens - 1) * gap for t in alone.values())
        stream_tokens = max(8 * s.decode_tokens, int(1.5 * probes_s / gap) + s.decode_tokens)
        streams = [asyncio.create_task(self.request(s.decode_prompt_tokens, stream_tokens))
                   for _ in range(s.overlap_streams)]
        # the streams' own prefills (one after another) and hand-offs are done: they decode now.  Waiting only the
        # longest prompt's TTFT left the first probes queued behind those prefills or beside one stream.
        await asyncio.sleep(s.overlap_streams * max(alone.values()) + 4 * gap)
        probes: list[tuple[int, RequestRecord]] = []
        for _ in range(repeats):
            for length in sorted(alone):
                probes.append((length, await self.request(length, s.prefill_max_tokens)))
        ended = min(r.start_s + r.e2e_s for r in await asyncio.gather(*streams))
        beside_s: dict[int, list[float]] = {}
        for length, r in probes:
            if r.start_s + r.ttft_s <= ended:
                beside_s.setdefault(length, []).append(r.ttft_s)
        points = tuple(PrefillBeside(n, alone[n], statistics.median(beside_s[n]), tuple(beside_s[n]))
                       for n in sorted(beside_s))
        if not points:
            raise RuntimeError("the decoding streams ended before any prefill probe: raise decode_tokens")
        return OverlapSample(gap, statistics.median(inside), s.overlap_streams, overhead_s, points)


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
            prefill_samples, alone = [], {}
            for length in settings.prompt_lengths:
                ttfts = []
                for _ in range(settings.repeats):
                    record = await prober.request(length, settings.prefill_max_tokens)
                    prefill_samples.append(PrefillSample(record.input_tokens, record.ttft_s))
                    ttfts.append(record.ttft_s)
                    progress.update(task, advance=1, description=f"prefill {length} tokens")
                alone[length] = statistics.median(ttfts)
            decode_samples = []
            for size in settings.batches:
                decode_samples.append(await prober.batch(size))
                progress.update(task, advance=1, description=f"decode batch {size}")
            context_samples = []
            for size in settings.context_batches:
                context_samples.append(await prober.context(size))
                progress.update(task, advance=1, description=f"decode batch {size}, long context")
            prefill = fit_prefill([p.prompt_tokens for p in prefill_samples], [p.ttft_s for p in prefill_samples])
            step = fit_step([d.batch for d in decode_samples], [d.step_s for d in decode_samples])
            overlap = None
            if settings.overlap:
                overlap = await prober.overlap(alone, way_in(prefill, step))
                progress.update(task, advance=1, description="replicas computing at once")
    return Profile(url, model, settings, prefill_samples, decode_samples, prefill, step, context_samples, overlap)
