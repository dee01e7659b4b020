"""Engine metrics as `LLM.get_metrics()` returns them (vLLM's Counter / Vector / Gauge / Histogram objects), and the
request-level statistics the output processor gathers for them. Names are vLLM's, with its `vllm:` prefix; a counter
is named as its family, without the `_total` its Prometheus samples carry (as vLLM's offline reader names it: e.g.
`vllm:prompt_tokens`), and the server's text format adds the suffix, so vLLM's Grafana dashboard finds them."""

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
class Vector(Metric):
    """Counters by position, in order: vLLM's vllm:spec_decode_num_accepted_tokens_per_pos (a `position` label on
    the server)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound ("+Inf" last) -> number of observations at or below it (cumulative)


PREFIX = "vllm:"

# seconds; the spread of a laptop CPU and a GPU server alike
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0)  # fmt: skip
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # vLLM's 1-2-5 series: 1, 2, 5, 10, ... 5e6
N_BUCKETS = (1, 2, 5, 10, 20)  # request_params_n, as vLLM


@dataclass
class HistogramData:
    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def to_metric(self, name: str, labels: dict[str, str]) -> Histogram:
        buckets, total = {}, 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += count
            buckets[bound] = total
        return Histogram(name, labels, total, self.sum, buckets)


def _latency() -> HistogramData:
    return HistogramData(LATENCY_BUCKETS)


def _tokens() -> HistogramData:
    return HistogramData(TOKEN_BUCKETS)


@dataclass
class RequestStats:
    """Totals over finished work, kept by the output processor; each histogram is named after its vLLM metric."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success_by_reason: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    time_to_first_token: HistogramData = field(default_factory=_latency)
    inter_token_latency: HistogramData = field(default_factory=_latency)
    e2e_request_latency: HistogramData = field(default_factory=_latency)
    request_queue_time: HistogramData = field(default_factory=_latency)  # arrival -> first scheduled
    request_prefill_time: HistogramData = field(default_factory=_latency)  # first scheduled -> first token
    request_decode_time: HistogramData = field(default_factory=_latency)  # first token -> finished
    request_inference_time: HistogramData = field(default_factory=_latency)  # first scheduled -> finished
    request_prompt_tokens: HistogramData = field(default_factory=_tokens)
    request_generation_tokens: HistogramData = field(default_factory=_tokens)  # all sequences of a request
    request_max_num_generation_tokens: HistogramData = field(default_factory=_tokens)  # its longest sequence
    request_params_max_tokens: HistogramData = field(default_factory=_tokens)
    request_params_n: HistogramData = field(default_factory=lambda: HistogramData(N_BUCKETS))

    def histograms(self) -> dict[str, HistogramData]:
        """vLLM's name (no prefix) -> histogram; the seed-era time_per_output_token_seconds is the same data as
        inter_token_latency_seconds."""
        return {
            "time_to_first_token_seconds": self.time_to_first_token,
            "inter_token_latency_seconds": self.inter_token_latency,
            "time_per_output_token_seconds": self.inter_token_latency,
            "e2e_request_latency_seconds": self.e2e_request_latency,
            "request_queue_time_seconds": self.request_queue_time,
            "request_prefill_time_seconds": self.request_prefill_time,
            "request_decode_time_seconds": self.request_decode_time,
            "request_inference_time_seconds": self.request_inference_time,
            "request_prompt_tokens": self.request_prompt_tokens,
            "request_generation_tokens": self.request_generation_tokens,
            "request_max_num_generation_tokens": self.request_max_num_generation_tokens,
            "request_params_max_tokens": self.request_params_max_tokens,
            "request_params_n": self.request_params_n,
        }


def engine_metrics(sched, stats: RequestStats, labels: dict[str, str], speculative: bool) -> list[Metric]:
    """The generative engine's metrics from its scheduler and request statistics, each under vLLM's current name
    and, where vLLM renamed it, its seed-era name too (gpu_cache_usage_perc, time_per_output_token_seconds, ...).
    pagedllm never swaps to CPU, so the swap gauges stay 0."""
    p = PREFIX
    usage = sched.kv.pool.usage()
    queries, hits = sched.kv.num_queries, sched.kv.num_hits
    metrics: list[Metric] = [
        Gauge(p + "num_requests_running", labels, len(sched.running)),
        Gauge(p + "num_requests_waiting", labels, len(sched.waiting)),
        Gauge(p + "num_requests_swapped", labels, 0),
        Gauge(p + "kv_cache_usage_perc", labels, usage),
        Gauge(p + "gpu_cache_usage_perc", labels, usage),
        Gauge(p + "cpu_cache_usage_perc", labels, 0.0),
        Gauge(p + "gpu_prefix_cache_hit_rate", labels, hits / queries if queries else 0.0),
        Counter(p + "prefix_cache_queries", labels, queries),
        Counter(p + "prefix_cache_hits", labels, hits),
        Counter(p + "num_preemptions", labels, sched.num_preemptions),
        Counter(p + "prompt_tokens", labels, stats.prompt_tokens),
        Counter(p + "generation_tokens", labels, stats.generation_tokens),
    ]
    if speculative:
        metrics += _spec_decode_metrics(sched, labels)
    for reason, count in stats.success_by_reason.items():
        metrics.append(Counter(p + "request_success", {**labels, "finished_reason": reason}, count))
    metrics += [hist.to_metric(p + name, labels) for name, hist in stats.histograms().items()]
    return metrics


def _spec_decode_metrics(sched, labels: dict[str, str]) -> list[Metric]:
    """vLLM's speculative-decoding counters: draft sequences, draft tokens, accepted tokens, and accepted tokens
    per position in the draft sequence (a Vector)."""
    p = PREFIX
    metrics: list[Metric] = [
        Counter(p + "spec_decode_num_drafts", labels, sched.num_drafts),
        Counter(p + "spec_decode_num_draft_tokens", labels, sched.num_draft_tokens),
        Counter(p + "spec_decode_num_accepted_tokens", labels, sched.num_accepted_tokens),
    ]
    metrics.append(Vector(p + "spec_decode_num_accepted_tokens_per_pos", labels, list(sched.num_accepted_per_pos)))
    return metrics
