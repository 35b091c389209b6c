"""Grammar compiles cannot stall a replica (issue 33, acceptance 2), on the
real cluster of this directory (1 decode replica: every stream shares it).

One plain stream decodes while eight requests arrive together, each with a
different JSON schema that takes about a second to compile (tests/slow_grammars.py),
plus one whose schema cannot compile within the replicas' limit
(grammar_compile_timeout_s: 5 CPU seconds on this directory's cluster).  The eight get
their answers; the ninth is a 400 naming the limit.  And the plain stream is never
stalled by them: over the whole burst, the time it spent in gaps of MAX_GAP_S or more
between two chunks is under half of what that one over-limit compile alone would stall
it on the engine thread (5 s of CPU take at least 5 s of wall time), let alone the
eight.  A bound from the compile limit, not a speed target: the machine's speed and
load do not move it, where a bound on the longest gap failed on a busy machine (one
gap of 1.17 s against 1.0 s) although every compile ran off the engine thread."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.integration.cluster.test_cluster_api import wait_no_leaks
from tests.slow_grammars import slow_schema

# slow: the compiles run at nice +10 beside a stream that takes a core.
pytestmark = [pytest.mark.integration, pytest.mark.slow]
MODEL = "SmolLM2-135M-Instruct"
MAX_GAP_S = 0.5  # a gap this long is a stall (the stream's tokens come every 10-20 ms)
# Off the engine thread the stalls summed to 0-1.2 s per burst (at most one gap of 0.36-1.17 s, at a random
# moment, on the shared 2-core machine: neither the collector nor the client); on it, each compile would stall
# every stream for its whole length.
COMPILE_LIMIT_CPU_S = 5.0  # grammar_compile_timeout_s of this directory's cluster (conftest.py)
MAX_STALLED_S = COMPILE_LIMIT_CPU_S / 2
STREAM_TOKENS = 3000     # KV for it fits 96 MiB; when the burst outlasts it, another starts
NUM_SLOW = 8            # distinct schemas, so no compile is shared (issue 33's acceptance: 8)
SLOW_PROPERTIES = 12     # about a second of CPU to compile and serialise on the 2-core test machine
OVER_LIMIT_PROPERTIES = 150   # far past 5 s
# A hang guard, not a speed target.
BURST_DEADLINE_S = 360.0


def _left(started: float) -> float:
    return max(BURST_DEADLINE_S - (time.monotonic() - started), 1.0)


def _schema_request(client, seed: int, num_properties: int):
    return client.with_options(timeout=BURST_DEADLINE_S).chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12,
        messages=[{"role": "user", "content": f"Fill in record {seed} as JSON."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": f"record{seed}", "schema": slow_schema(seed, num_properties), "strict": True}})


class _Stream:
    """Plain streams in a thread, one after another until told to stop (a loaded
    machine can make the burst outlast one): the time of every chunk, per stream."""

    def __init__(self, client):
        self.client, self.streams, self.first = client, [], threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            times: list[float] = []
            self.streams.append(times)
            stream = self.client.completions.create(model=MODEL, prompt="Count slowly: one, two,",
                                                    max_tokens=STREAM_TOKENS, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True})
            try:
                for _ in stream:
                    times.append(time.monotonic())
                    self.first.set()
                    if self.stop.is_set():
                        return
            finally:
                stream.close()

    @property
    def num_chunks(self) -> int:
        return sum(len(t) for t in self.streams)

    def max_gap_s(self, since: float, until: float) -> float:
        """The largest gap between two chunks of one stream over [since, until]
        (from the last chunk before ``since``); not the wait for a new stream's first token."""
        return max(self.gaps_s(since, until), default=float("inf"))

    def gaps_s(self, since: float, until: float) -> list[float]:
        gaps = []
        for times in self.streams:
            inside = [t for t in times if since <= t <= until]
            points = [t for t in times if t < since][-1:] + inside
            gaps += [b - a for a, b in zip(points, points[1:])]
        return gaps


def test_slow_schema_compiles_do_not_stall_another_stream_and_over_the_limit_is_400(cluster, client):
    stream = _Stream(client)
    try:
        assert stream.first.wait(60), "the plain stream never started"
        burst_started = time.monotonic()
        with ThreadPoolExecutor(max_workers=NUM_SLOW + 1) as pool:
            slow = [pool.submit(_schema_request, client, seed, SLOW_PROPERTIES) for seed in range(100, 100 + NUM_SLOW)]
            over = pool.submit(_schema_request, client, 999, OVER_LIMIT_PROPERTIES)
            answers = [f.result(timeout=_left(burst_started)) for f in slow]
            slow_done = time.monotonic()
            with pytest.raises(openai.BadRequestError) as err:
                over.result(timeout=_left(burst_started))
        burst_ended = time.monotonic()
    finally:
        # Stopped however the burst ends: a stream left running would load every later test of the directory.
        stream.stop.set()
        stream.thread.join(30)
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    assert "grammar compile limit" in err.value.body["message"]
    assert "grammar_compile_timeout_s" in err.value.body["message"]
    gap = stream.max_gap_s(burst_started, burst_ended)
    print(f"burst {burst_ended - burst_started:.1f} s (the slow ones answered after {slow_done - burst_started:.1f} s); "
          f"the plain streams' largest gap {gap:.3f} s over {stream.num_chunks} chunks in {len(stream.streams)} "
          "stream(s)")
    stalls = sorted((g for g in stream.gaps_s(burst_started, burst_ended) if g >= MAX_GAP_S), reverse=True)
    assert sum(stalls) < MAX_STALLED_S, f"plain streams waited {stalls} s between chunks during the compiles"
    wait_no_leaks(cluster)
