"""What tracing costs per span and per request (7 stage spans + the root).

    .venv/bin/python -m bench.micro.span_cost [--spans 20000]

Times ``tracing.span()`` with typical attributes three ways in one run:
off (no setup_tracing: OpenTelemetry's non-recording spans), the default
JSONL exporter behind a BatchSpanProcessor, and the same exporter behind a
SimpleSpanProcessor (writes on the caller's thread).  "caller" is what the
event loop feels; "total" adds the export thread's work (flush included),
which shares the GIL with the event loop.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.fingerprint import print_fingerprint
from pdcluster.observability import tracing
SPANS_PER_REQUEST = 8
ATTRS = {"replica": "prefill-3f2a", "prompt.tokens": 512, "prompt.cached_tokens": 256, "cache.hit_blocks": 16,
         "finish_reason": "stop"}


def _run(n: int, chunk: int = 500) -> tuple[float, float]:
    """(caller seconds, total seconds) for n spans, each a child via a carrier.
    Flushes every ``chunk`` spans so the batch queue never overflows (a
    dropped span would look free)."""
    with tracing.span("gateway.request") as root:
        carrier = tracing.inject(root)
    caller = 0.0
    start = time.perf_counter()
    for _ in range(0, n, chunk):
        t = time.perf_counter()
        for _ in range(chunk):
            with tracing.span("prefill.compute", carrier, ATTRS):
                pass
        caller += time.perf_counter() - t
        tracing.force_flush(60_000)
    return caller, time.perf_counter() - start


def _simple_processor(path: Path) -> None:
    """Swaps the configured processors for a SimpleSpanProcessor over the same exporter."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from pdcluster.observability.exporters import JsonlSpanExporter

    tracing._reset_for_tests()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path, tracing.drop_text)))
    tracing._state.configured, tracing._state.provider = True, provider
    tracing._state.tracer = provider.get_tracer("pdcluster")


def _modes(tmp: Path) -> dict[str, Callable[[], None]]:
    def off() -> None:
        tracing._reset_for_tests()  # unconfigured: OpenTelemetry's proxy (non-recording) spans

    def batch() -> None:
        tracing._reset_for_tests()
        tracing.setup_tracing("bench", jsonl_path=tmp / "batch.jsonl")

    return {"off": off, "jsonl, batch (default)": batch, "jsonl, simple": lambda: _simple_processor(tmp / "s.jsonl")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=5, help="rounds; the best round per mode is reported")
    args = ap.parse_args(argv)
    print_fingerprint()
    n = args.spans
    best: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):  # modes interleaved, so background load hits them alike
            for mode, configure in _modes(Path(tmp)).items():
                configure()
                _run(500)  # warm-up
                caller, total = _run(n)
                if mode not in best or total < best[mode][1]:
                    best[mode] = (caller, total)
        tracing._reset_for_tests()
    print(f"{n} spans per round, best of {args.repeat} rounds, {len(ATTRS)} attributes per span")
    print(f"{'mode':<24} {'caller us/span':>15} {'total us/span':>14} {'spans/s':>10} "
          f"{'us/request (x' + str(SPANS_PER_REQUEST) + ')':>20}")
    for mode, (caller, total) in best.items():
        print(f"{mode:<24} {caller / n * 1e6:>15.1f} {total / n * 1e6:>14.1f} {n / total:>10.0f} "
              f"{total / n * 1e6 * SPANS_PER_REQUEST:>20.0f}")
    off, batch = best["off"][1], best["jsonl, batch (default)"][1]
    print(f"batch vs off: {batch / off:.1f}x per span; "
          f"+{(batch - off) / n * SPANS_PER_REQUEST * 1e3:.3f} ms per request")
    print(f"reproduce: .venv/bin/python -m bench.micro.span_cost --spans {n} --repeat {args.repeat}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
