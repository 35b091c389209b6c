"""`pdcluster bench`'s load generator against the real cluster."""

from __future__ import annotations

import asyncio

import pytest

from bench.load.loadgen import run_workload
from bench.load.report import build_report
from bench.tokenizer import load_tokenizer
from bench.workload import load_workload
from tests.bench_checks import check_percentiles

pytestmark = pytest.mark.integration


def test_tiny_workload_against_the_cluster(cluster, base_url):
    workload = load_workload("tiny")
    result = asyncio.run(run_workload(base_url, workload, load_tokenizer(None), show_progress=False))
    report = build_report(result, "pytest")
    assert report.overall.requests == 12 and report.overall.ok == 12, report.overall.errors
    assert all(r.usage_reported and r.output_tokens == r.planned_output_tokens for r in result.records)
    assert report.overall.output_tokens == sum(r.planned_output_tokens for r in result.records)
    check_percentiles(report, result)
