"""vLLM's metric families at the gateway's /metrics
(pdcluster/observability/vllm_families.py): vLLM's names, types, buckets and
``model_name``; a cluster-wide series without ``pool`` beside one per pool;
numbers that follow the requests and the board."""

from __future__ import annotations

import pytest
from openai_fakes import MODEL, FakeBackend
from prometheus_client.parser import text_string_to_metric_families
from test_openai_metrics import FakeBoard, app_with, client_of, status, value

from pdcluster.observability.histogram import CumulativeHistogram, merged
from pdcluster.observability.vllm_families import REQUEST_LATENCY_BUCKETS
from pdcluster.services.openai.gateway_metrics import GatewayMetrics
from pdcluster.services.openai.slo import Slo

# Written out here, not imported: these are vLLM v1's (vllm/v1/metrics/loggers.py), and must stay so.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0]
VLLM_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]
FAMILIES = {   # name as the parser reports it -> (type, its buckets)
    "vllm:num_requests_running": ("gauge", None), "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None), "vllm:cache_config_info": ("gauge", None),
    "vllm:prompt_tokens": ("counter", None), "vllm:generation_tokens": ("counter", None),
    "vllm:prefix_cache_queries": ("counter", None), "vllm:prefix_cache_hits": ("counter", None),
    "vllm:time_to_first_token_seconds": ("histogram", VLLM_TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", VLLM_ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", VLLM_LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", VLLM_LATENCY),
}
INFO_LABELS = {"block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"}


def queue_snapshot(*seconds: float) -> dict:
    h = CumulativeHistogram(REQUEST_LATENCY_BUCKETS)
    for s in seconds:
        h.observe(s)
    return h.snapshot()


def board() -> FakeBoard:
    return FakeBoard([
        status("prefill", "prefill-a", kv_dtype="bf16", queue_time_s=queue_snapshot(0.2, 0.4)),
        status("prefill", "prefill-b", kv_blocks_free=100, running=0, waiting=0, awaiting_kv=0,
               kv_dtype="bf16", queue_time_s=queue_snapshot(3.0)),
        status("decode", "decode-a", kv_blocks_total=300, kv_blocks_free=0, kv_dtype="bf16",
               queue_time_s={"boundaries": [1.0], "counts": [1, 0], "sum": 0.5},   # other buckets: skipped
               counters={"bytes_pulled": 4096, "transfer_seconds": 0.5}),
        {"role": "decode", "name": "broken"},
    ])


async def scrape_text(c) -> str:
    r = await c.get("/metrics")
    assert r.status_code == 200, r.text
    return r.text


async def test_every_family_has_vllms_type_buckets_and_model_name(tokenizer):
    metrics = GatewayMetrics(board=board(), model_name=MODEL, block_size=16)
    async with client_of(app_with(FakeBackend(), tokenizer, metrics)) as c:
        text = await scrape_text(c)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, buckets) in FAMILIES.items():
        assert families[name].type == kind, name
        samples = families[name].samples
        assert samples and all(s.labels["model_name"] == MODEL for s in samples), name
        assert {s.labels.get("pool") for s in samples} >= {None}, f"{name}: no cluster-wide series"
        allowed = {"model_name", "pool", "le"} | (INFO_LABELS if name == "vllm:cache_config_info" else set())
        assert set().union(*(s.labels for s in samples)) <= allowed, name
        if buckets is not None:
            les = [s.labels["le"] for s in samples if s.name.endswith("_bucket") and "pool" not in s.labels]
            assert les == [repr(b) for b in buckets] + ["+Inf"], name
    # Every vLLM family is written once: a second TYPE line would make Prometheus refuse the scrape.
    assert sum(line.startswith("# TYPE vllm:") for line in text.splitlines()) == len(FAMILIES)


async def test_board_families_sum_per_pool_and_for_the_cluster(tokenizer):
    metrics = GatewayMetrics(board=board(), model_name=MODEL, block_size=16)
    async with client_of(app_with(FakeBackend(), tokenizer, metrics)) as c:
        f = {fam.name: fam.samples for fam in text_string_to_metric_families(await scrape_text(c))}
    m = {"model_name": MODEL}
    pre, dec = {**m, "pool": "prefill"}, {**m, "pool": "decode"}
    assert value(f, "vllm:num_requests_running", **m) == 4 and value(f, "vllm:num_requests_running", **pre) == 2
    assert value(f, "vllm:num_requests_waiting", **dec) == 2 and value(f, "vllm:num_requests_waiting", **m) == 4
    assert value(f, "vllm:kv_cache_usage_perc", **pre) == 40 / 200
    assert value(f, "vllm:kv_cache_usage_perc", **dec) == 1.0
    assert value(f, "vllm:kv_cache_usage_perc", **m) == 340 / 500
    assert value(f, "vllm:prefix_cache_queries_total", **pre) == 2 * 364
    assert value(f, "vllm:prefix_cache_hits_total", **dec) == 64
    assert value(f, "vllm:request_queue_time_seconds_count", **pre) == 3
    assert value(f, "vllm:request_queue_time_seconds_bucket", **pre, le="0.3") == 1
    assert value(f, "vllm:request_queue_time_seconds_bucket", **pre, le="0.5") == 2
    assert value(f, "vllm:request_queue_time_seconds_count", **dec) == 0   # its snapshot had other buckets
    assert value(f, "vllm:request_queue_time_seconds_count", **m) == 3
    assert value(f, "vllm:request_queue_time_seconds_sum", **m) == pytest.approx(3.6)
    info = {s.labels.get("pool"): s.labels for s in f["vllm:cache_config_info"]}
    assert info[None]["num_gpu_blocks"] == "500" and info["decode"]["num_gpu_blocks"] == "300"
    assert info[None]["block_size"] == "16" and info[None]["cache_dtype"] == "bf16"
    assert value(f, "pdcluster_kv_transfer_bytes_total", pool="decode", replica="decode-a") == 4096
    assert value(f, "pdcluster_kv_transfer_seconds_total", pool="prefill", replica="prefill-a") == 0


async def test_request_families_move_with_traffic(tokenizer):
    backend = FakeBackend()
    backend.script.cached_tokens = 2
    metrics = GatewayMetrics(model_name=MODEL, slo=Slo(ttft_s=60.0, tpot_s=60.0))
    async with client_of(app_with(backend, tokenizer, metrics)) as c:
        before = {fam.name: fam.samples for fam in text_string_to_metric_families(await scrape_text(c))}
        assert value(before, "vllm:time_to_first_token_seconds_count", model_name=MODEL) == 0
        assert "vllm:num_requests_running" in before   # no board: the family is there, without samples
        r = await c.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 3})
        assert r.status_code == 200
        usage = r.json()["usage"]
        f = {fam.name: fam.samples for fam in text_string_to_metric_families(await scrape_text(c))}
    m = {"model_name": MODEL}
    assert value(f, "vllm:prompt_tokens_total", **m) == usage["prompt_tokens"]
    assert value(f, "vllm:prefix_cache_queries_total", **m) == usage["prompt_tokens"]
    assert value(f, "vllm:prefix_cache_hits_total", **m) == 2
    assert value(f, "vllm:generation_tokens_total", **m) == usage["completion_tokens"] == 3
    assert value(f, "vllm:time_to_first_token_seconds_count", **m) == 1
    assert value(f, "vllm:inter_token_latency_seconds_count", **m) == 2   # three one-token chunks: two gaps
    assert value(f, "vllm:e2e_request_latency_seconds_count", **m) == 1
    assert value(f, "pdcluster_slo_requests_total", outcome="met") == 1
    assert value(f, "pdcluster_slo_requests_total", outcome="missed") == 0
    assert value(f, "pdcluster_slo_ttft_seconds") == 60.0


def test_slo_outcome():
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    assert slo.outcome(0.5, 0.05) == "met" and slo.outcome(0.5, None) == "met"
    assert slo.outcome(1.5, 0.05) == "missed" and slo.outcome(0.5, 0.2) == "missed"
    assert slo.outcome(None, None) == "missed"
    with pytest.raises(ValueError, match="ttft_slo_s"):
        Slo(ttft_s=0, tpot_s=0.1)


def test_histogram_buckets_merge_and_refuse_bad_snapshots():
    h = CumulativeHistogram((0.5, 1.0))
    for v in (0.5, 0.7, 3.0, -1.0, float("nan")):
        h.observe(v)
    assert h.counts == [1, 1, 1] and h.count == 3 and h.sum == pytest.approx(4.2)
    assert h.cumulative() == [("0.5", 1), ("1.0", 2), ("+Inf", 3)]
    again = CumulativeHistogram.from_snapshot(h.snapshot())
    assert merged((0.5, 1.0), [h, again, CumulativeHistogram((2.0,))]).counts == [2, 2, 2]
    with pytest.raises(ValueError, match="ascending"):
        CumulativeHistogram((1.0, 0.5))
    with pytest.raises(ValueError, match="plus \\+Inf"):
        CumulativeHistogram.from_snapshot({"boundaries": [1.0], "counts": [1], "sum": 0})
    with pytest.raises(ValueError, match="negative"):
        CumulativeHistogram.from_snapshot({"boundaries": [1.0], "counts": [1, -1], "sum": 0})


def test_engine_queue_times_are_kept_for_the_board_without_ray():
    from pdcluster.observability import metrics

    metrics._reset_for_tests()
    metrics.observe_queue("prefill", 0.4)
    metrics.observe_queue("prefill", 2.2)
    snap = metrics.queue_times("prefill").snapshot()
    assert CumulativeHistogram.from_snapshot(snap).cumulative()[:6] == [
        ("0.3", 0), ("0.5", 1), ("0.8", 1), ("1.0", 1), ("1.5", 1), ("2.0", 1)]
    assert metrics.queue_times("decode").count == 0
    metrics._reset_for_tests()
