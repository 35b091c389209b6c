"""deploy/grafana/pdcluster.json, without Prometheus: Grafana's shape (a
Prometheus data-source variable, unique panel ids, every target with an
expression), and every series a panel reads is one the gateway's /metrics
writes.  That each query returns data is checked against a real Prometheus
in tests/integration/cluster/test_cluster_grafana_dashboard.py."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdcluster.observability.dashboard_plot import expr_for_prometheus
from pdcluster.services.openai.gateway_metrics import GatewayMetrics
from pdcluster.services.openai.slo import Slo

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "pdcluster.json"
SERIES = re.compile(r"\b(vllm:[a-z0-9_]+|pdcluster_[a-z0-9_]+)")
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


class Board:
    async def read(self):
        return [{"name": "decode-1", "role": "decode", "running": 0, "waiting": 0, "awaiting_kv": 0,
                 "kv_blocks_total": 10, "kv_blocks_free": 10, "prompt_tokens_computed": 0,
                 "prompt_tokens_cached": 0, "counters": {"bytes_pulled": 1, "transfer_seconds": 1}}]


def exposed_families() -> set[str]:
    admission = {"in_flight": 0, "shed": 0, "over_capacity": 0, "pools": {"prefill": {"queued_tokens": 0}}}
    metrics = GatewayMetrics(board=Board(), admission_view=lambda: admission,
                             failover_view=lambda: {"resumed": {"replica_died": 1}}, model_name="m",
                             slo=Slo(1.0, 0.1))
    text = asyncio.run(metrics.exposition()).decode()
    return {f.name for f in text_string_to_metric_families(text)}


def family_of(series: str, exposed: set[str]) -> str:
    """The family a sample name belongs to (a gauge may itself end in _total)."""
    if series in exposed:
        return series
    return next((series.removesuffix(s) for s in SUFFIXES if series.endswith(s)), series)


def test_dashboard_shape():
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus" and "model_name" in variables
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert all(t["expr"].strip() and t["refId"] for t in panel["targets"]), panel["title"]
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("first token", "output token", "end-to-end", "goodput", "running", "waiting", "kv cache",
                  "prefix", "transfer", "admission", "failover"):
        assert topic in titles, topic


def test_every_series_a_panel_reads_is_exposed():
    exposed = exposed_families()
    dash = json.loads(DASHBOARD.read_text())
    read = {family_of(s, exposed) for p in dash["panels"] for t in p["targets"] for s in SERIES.findall(t["expr"])}
    assert read and read - exposed == set(), sorted(read - exposed)


def test_grafana_variables_are_filled_for_prometheus():
    expr = 'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])'
    assert expr_for_prometheus(expr, "m") == 'rate(vllm:prompt_tokens_total{model_name="m"}[1m])'
