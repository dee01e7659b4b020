"""The engine's metrics (LLMEngine.get_metrics(): Counter / Vector / Gauge / Histogram objects named `vllm:...`) in
Prometheus' text exposition format, version 0.0.4: a counter's samples carry `_total`, a Vector is a counter with
one sample per `position`."""

from __future__ import annotations

import dataclasses

from pagedllm.metrics import Counter, Gauge, Histogram, Metric, Vector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_HELP = {
    "num_requests_running": "Number of requests in the model execution batch.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "num_requests_swapped": "Number of requests swapped to CPU (always 0: pagedllm preempts by recomputation).",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "gpu_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage (older name of kv_cache_usage_perc).",
    "cpu_cache_usage_perc": "CPU swap-space usage (always 0: pagedllm does not swap).",
    "gpu_prefix_cache_hit_rate": "Prefix cache hit rate over all queried tokens so far.",
    "prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
    "num_preemptions_total": "Cumulative number of preemptions from the engine.",
    "prompt_tokens_total": "Number of prefill tokens processed.",
    "generation_tokens_total": "Number of generation tokens processed.",
    "request_success_total": "Count of successfully processed requests.",
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "time_per_output_token_seconds": "Histogram of time per output token in seconds (older name).",
    "e2e_request_latency_seconds": "Histogram of end to end request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "request_params_n": "Histogram of the n request parameter.",
}


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str], extra: dict[str, str] | None = None) -> str:
    items = {**labels, **(extra or {})}
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items.items()) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if not float(value).is_integer() else f"{float(value):.1f}"


def _family(metric: Metric) -> tuple[str, str]:
    """(family name, type). A counter's HELP and TYPE lines name it with the `_total` its samples carry, as
    prometheus-client writes the text format and as its parser reads it (a TYPE without `_total` leaves the family
    empty and the samples untyped)."""
    if isinstance(metric, (Counter, Vector)):
        return metric.name + "_total", "counter"
    if isinstance(metric, Histogram):
        return metric.name, "histogram"
    return metric.name, "gauge"


def _samples(metric: Metric) -> list[str]:
    labels = metric.labels
    if isinstance(metric, Histogram):
        lines = [f"{metric.name}_bucket{_labels(labels, {'le': le})} {_number(n)}" for le, n in metric.buckets.items()]
        lines.append(f"{metric.name}_count{_labels(labels)} {_number(metric.count)}")
        lines.append(f"{metric.name}_sum{_labels(labels)} {_number(metric.sum)}")
        return lines
    if isinstance(metric, Vector):
        name = metric.name + "_total"
        return [f"{name}{_labels(labels, {'position': str(i)})} {_number(v)}" for i, v in enumerate(metric.values)]
    if isinstance(metric, Counter):
        return [f"{metric.name}_total{_labels(labels)} {_number(metric.value)}"]
    if isinstance(metric, Gauge):
        return [f"{metric.name}{_labels(labels)} {_number(metric.value)}"]
    return []


def render(metrics: list[Metric]) -> str:
    families: dict[str, tuple[str, list[str]]] = {}
    for metric in metrics:
        name, kind = _family(metric)
        families.setdefault(name, (kind, []))[1].extend(_samples(metric))
    lines = []
    for name, (kind, samples) in families.items():
        lines.append(f"# HELP {name} {_HELP.get(name.partition(':')[2], name)}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples)
    return "\n".join(lines) + "\n"


def renamed(metrics: list[Metric], prefixes: tuple[str, ...]) -> list[Metric]:
    """Copies of the metrics under each other prefix (`vllm:x` -> `pagedllm:x` for prefix "pagedllm")."""
    return [
        dataclasses.replace(m, name=f"{prefix.rstrip(':')}:{m.name.partition(':')[2]}", labels=dict(m.labels))
        for prefix in prefixes
        for m in metrics
    ]
