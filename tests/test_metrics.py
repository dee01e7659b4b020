"""The metric objects: histogram buckets are cumulative counts of observations at or below each bound."""

from __future__ import annotations

import random

from pagedllm.metrics import LATENCY_BUCKETS, HistogramData


def test_histogram_buckets_are_cumulative():
    rng = random.Random(0)
    values = [rng.uniform(0, 3) for _ in range(200)] + [0.1, 1.0, 1e4]  # bounds themselves and one above all
    hist = HistogramData()
    for v in values:
        hist.observe(v)
    metric = hist.to_metric("vllm:x_seconds", {"model_name": "m"})
    assert metric.count == len(values)
    assert metric.sum == sum(values)
    assert list(metric.buckets) == [str(b) for b in LATENCY_BUCKETS] + ["+Inf"]
    for bound in LATENCY_BUCKETS:
        assert metric.buckets[str(bound)] == sum(v <= bound for v in values)
    assert metric.buckets["+Inf"] == len(values)
