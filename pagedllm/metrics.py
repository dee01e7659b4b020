"""Engine metrics as `LLM.get_metrics()` returns them (vLLM's Counter / Gauge / Histogram objects), and the
request-level statistics the output processor gathers for them. Names carry the `pagedllm:` prefix and the
Prometheus suffixes (`_total` for counters), so the server can expose them as they are."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound ("+Inf" last) -> number of observations at or below it (cumulative)


# seconds; the spread of a laptop CPU and a GPU server alike
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0)  # fmt: skip


@dataclass
class HistogramData:
    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    sum: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def to_metric(self, name: str, labels: dict[str, str]) -> Histogram:
        buckets, total = {}, 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += count
            buckets[bound] = total
        return Histogram(name, labels, total, self.sum, buckets)


@dataclass
class RequestStats:
    """Totals over finished work, kept by the output processor."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success_by_reason: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    time_to_first_token: HistogramData = field(default_factory=HistogramData)
    inter_token_latency: HistogramData = field(default_factory=HistogramData)
    e2e_request_latency: HistogramData = field(default_factory=HistogramData)
