"""Checks on load-generator reports shared by the unit (fake server) and
integration (real cluster) tests."""

import numpy as np
import pytest

from bench.load.report import metric_samples


def check_percentiles(report, result):
    """Percentiles ordered, inside the raw samples' range, and equal to numpy's on them."""
    for group in [report.overall, *report.buckets]:
        records = result.records if group.name == "overall" else [r for r in result.records if r.bucket == group.name]
        for metric, dist in group.latency.items():
            samples = metric_samples(records, metric)
            if dist is None:
                assert not samples
                continue
            assert dist.count == len(samples)
            assert dist.min <= dist.p50 <= dist.p95 <= dist.p99 <= dist.max
            assert (dist.min, dist.max) == (min(samples), max(samples))
            assert dist.p99 == pytest.approx(np.percentile(samples, 99))
