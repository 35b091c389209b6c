"""pdcluster.observability.stages: the stage spans a replica records from engine
outputs, and the gateway's stream wrapper."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from span_helpers import finished_spans

from pdcluster.observability import metrics, tracing
from pdcluster.services.messages import TokenDelta
from pdcluster.services.engine.request import FinishReason
from pdcluster.observability.stages import DecodeStages, PrefillStages, WholeStages


@pytest.fixture
def observed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    for name in ("observe_ttft", "observe_tpot", "observe_e2e", "observe_queue", "count_prompt_tokens",
                 "count_transfer"):
        monkeypatch.setattr(metrics, name, lambda *a, _n=name: calls.append((_n, a)))
    return calls


def _out(tokens: list[int], scheduled_s: float | None = None, finished: FinishReason | None = None) -> Any:
    return SimpleNamespace(new_token_ids=tokens, num_prompt_tokens=40, num_cached_tokens=32,
                           first_scheduled_s=scheduled_s, finished=finished is not None, finish_reason=finished,
                           prefill=None)


def test_prefill_stages_split_queue_and_compute(span_file: Path, observed: list) -> None:
    tracing.setup_tracing("pdcluster-prefill", jsonl_path=span_file)
    with tracing.span("gateway.request") as root:
        carrier = tracing.inject(root)
    stages = PrefillStages(carrier, "prefill-1", block_size=16)
    time.sleep(0.01)
    scheduled = time.monotonic()
    time.sleep(0.02)
    stages.done(_out([7], scheduled, FinishReason.PREFILLED))
    spans = finished_spans(span_file)
    queue, compute = spans["prefill.queue"], spans["prefill.compute"]
    assert queue["parent_span_id"] == compute["parent_span_id"] == spans["gateway.request"]["span_id"]
    # The split is at ``scheduled``: >= 10 ms of queue before it, >= 20 ms of compute after it
    # (sleeps only overshoot on a loaded machine, so lower bounds are the robust ones).
    assert queue["end_ns"] == compute["start_ns"]
    assert queue["end_ns"] - queue["start_ns"] >= 9e6 and compute["end_ns"] - compute["start_ns"] >= 19e6
    assert compute["attributes"] == {"replica": "prefill-1", "prompt.tokens": 40, "prompt.cached_tokens": 32,
                                     "cache.hit_blocks": 2, "finish_reason": "prefilled"}
    assert [name for name, _ in observed] == ["observe_queue", "observe_ttft", "observe_e2e",
                                              "count_prompt_tokens"]


def test_decode_stages_in_order(span_file: Path, observed: list) -> None:
    tracing.setup_tracing("pdcluster-decode", jsonl_path=span_file)
    stages = DecodeStages({}, "decode-1", 16, "socket")
    stages.reserved()
    stats = SimpleNamespace(num_bytes=1 << 20, seconds=0.004, gbytes_per_s=(1 << 20) / 0.004 / 1e9)
    stages.pulled(SimpleNamespace(num_cached_blocks=1), stats, 2)
    scheduled = time.monotonic()
    stages.on_output(_out([5], scheduled))
    stages.on_output(_out([6, 7], None, FinishReason.STOP))
    stages.finish()
    spans = finished_spans(span_file)
    kv, queue, gen = spans["kv.transfer"], spans["decode.queue"], spans["decode.generate"]
    assert kv["end_ns"] <= queue["start_ns"] <= queue["end_ns"] <= gen["start_ns"] <= gen["end_ns"]
    assert kv["attributes"]["kv.bytes"] == 1 << 20 and kv["attributes"]["kv.gbps"] == pytest.approx(0.262, abs=1e-3)
    assert gen["attributes"]["output.tokens"] == 3 and gen["attributes"]["finish_reason"] == "stop"
    assert ("count_transfer", ("socket", 1 << 20, 0.004)) in observed
    assert "observe_ttft" not in [name for name, _ in observed]  # the prefill pool's number


def test_decode_generate_ends_with_the_last_token_not_the_generator_close(span_file: Path, observed: list) -> None:
    # The gateway ends its span (the parent) when it has the last token; the replica's
    # ``finally`` may run later. The span ends at the output that finished the decode.
    tracing.setup_tracing("pdcluster-decode", jsonl_path=span_file)
    stages = DecodeStages({}, "decode-1", 16, "socket")
    stats = SimpleNamespace(num_bytes=1, seconds=0.001, gbytes_per_s=0.001)
    stages.pulled(SimpleNamespace(num_cached_blocks=0), stats, 1)
    stages.on_output(_out([5], time.monotonic()))
    stages.on_output(_out([6], None, FinishReason.STOP))
    last_token_s = time.monotonic()
    time.sleep(0.05)
    closed_s = time.monotonic()
    stages.finish()
    gen = finished_spans(span_file)["decode.generate"]
    assert gen["end_ns"] <= tracing.mono_to_ns(last_token_s, stages._offset_ns) < \
        tracing.mono_to_ns(closed_s, stages._offset_ns)


def test_decode_stage_failure_before_pull_is_an_error_kv_span(span_file: Path, observed: list) -> None:
    tracing.setup_tracing("pdcluster-decode", jsonl_path=span_file)
    DecodeStages({}, "decode-2", 16, "socket").finish(RuntimeError("transfer failed"))
    kv = finished_spans(span_file)["kv.transfer"]
    assert kv["status"] == "ERROR" and "transfer failed" in kv["status_message"]


def test_whole_stages_split_queue_compute_and_generate_under_the_gateway_span(span_file: Path,
                                                                              observed: list) -> None:
    """Both phases on one replica (colocated, a decode replica's fallback): the queue ends at the first
    step, the prefill at the first token, the decode at the last token; spans only, no metrics."""
    tracing.setup_tracing("pdcluster-colocated", jsonl_path=span_file)
    with tracing.span("gateway.request") as root:
        carrier = tracing.inject(root)
    stages = WholeStages(carrier, "colocated-1", 16)
    time.sleep(0.01)
    scheduled = time.monotonic()
    stages.on_output(_out([], scheduled))  # a prompt chunk: no token yet
    time.sleep(0.02)
    stages.on_output(_out([5], scheduled))
    stages.on_output(_out([6, 7], scheduled, FinishReason.LENGTH))
    stages.finish(GeneratorExit())  # the consumer closed the stream after its last token: served whole
    spans = finished_spans(span_file)
    queue, compute, gen = spans["prefill.queue"], spans["prefill.compute"], spans["decode.generate"]
    assert gen["status"] != "ERROR" and compute["status"] != "ERROR"
    root_id = spans["gateway.request"]["span_id"]
    assert queue["parent_span_id"] == compute["parent_span_id"] == gen["parent_span_id"] == root_id
    assert queue["end_ns"] == compute["start_ns"] and compute["end_ns"] == gen["start_ns"]
    assert queue["end_ns"] - queue["start_ns"] >= 9e6 and compute["end_ns"] - compute["start_ns"] >= 19e6
    assert compute["attributes"] == {"replica": "colocated-1", "prompt.tokens": 40, "prompt.cached_tokens": 32,
                                     "cache.hit_blocks": 2}
    assert gen["attributes"] == {"replica": "colocated-1", "output.tokens": 3, "finish_reason": "length"}
    assert observed == []  # stream_whole_request keeps the replica's metrics


def test_whole_stages_failure_before_the_first_token_is_an_error_compute_span(span_file: Path,
                                                                              observed: list) -> None:
    tracing.setup_tracing("pdcluster-colocated", jsonl_path=span_file)
    stages = WholeStages({}, "colocated-2", 16)
    stages.finish(RuntimeError("engine step failed"))
    spans = finished_spans(span_file)
    assert spans["prefill.compute"]["status"] == "ERROR" and "engine step failed" in \
        spans["prefill.compute"]["status_message"]
    assert "decode.generate" not in spans


def test_gateway_stream_times_tokens_and_closes_the_backend(span_file: Path, observed: list) -> None:
    """The gateway's one stream wrapper (pdcluster/services/openai/gateway_metrics.py) also feeds Ray's
    gateway-pool histograms and the root span."""
    from opentelemetry import trace

    from pdcluster.services.openai.gateway_metrics import GatewayMetrics

    tracing.setup_tracing("pdcluster-gateway", jsonl_path=span_file)
    closed = []

    async def backend():
        try:
            yield TokenDelta([1], "a", num_cached_tokens=16)
            yield TokenDelta([2, 3], "bc", "stop")
            yield TokenDelta([4], "never read")
        finally:
            closed.append(True)

    async def consume() -> None:
        with tracing.span("gateway.request"):
            chunks = GatewayMetrics().observe_stream(backend(), num_prompt_tokens=20, root=trace.get_current_span())
            async for chunk in chunks:  # like generation.py: stop at the finish reason, then aclose
                if chunk.finish_reason:
                    break
            await chunks.aclose()

    asyncio.run(consume())
    assert closed == [True]
    root = finished_spans(span_file)["gateway.request"]
    assert root["attributes"] == {"prompt.tokens": 20, "prompt.cached_tokens": 16, "output.tokens": 3,
                                  "finish_reason": "stop"}
    assert [name for name, _ in observed] == ["observe_ttft", "observe_tpot", "observe_e2e"]


def test_every_stage_span_carries_the_requests_tenant_and_class(span_file: Path, observed: list) -> None:
    from pdcluster.services.sampling_params import SamplingParams
    from pdcluster.services.messages import GenerateRequest
    from pdcluster.router.routing_header import RoutingHeader

    tracing.setup_tracing("pdcluster-prefill", jsonl_path=span_file)
    req = GenerateRequest("r1", [1, 2], SamplingParams(tenant="gold", priority=-3), RoutingHeader((), 2, 16, 1))
    stages = PrefillStages({}, "prefill-1", 16, req.span_tags())
    stages.done(_out([7], time.monotonic(), FinishReason.PREFILLED))
    spans = finished_spans(span_file)
    for name in ("prefill.queue", "prefill.compute"):
        assert spans[name]["attributes"]["request.tenant"] == "gold"
        assert spans[name]["attributes"]["request.priority"] == -3
