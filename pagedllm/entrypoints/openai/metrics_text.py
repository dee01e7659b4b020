"""The engine's metrics (LLMEngine.get_metrics(): Counter / Gauge / Histogram objects already named
`pagedllm:...`) in Prometheus' text exposition format, version 0.0.4."""

from __future__ import annotations

from pagedllm.metrics import Counter, Gauge, Histogram, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_HELP = {
    "pagedllm:num_requests_running": "Number of requests in the model execution batch.",
    "pagedllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "pagedllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "pagedllm:prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "pagedllm:prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
    "pagedllm:num_preemptions_total": "Cumulative number of preemptions from the engine.",
    "pagedllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "pagedllm:generation_tokens_total": "Number of generation tokens processed.",
    "pagedllm:request_success_total": "Count of successfully processed requests.",
    "pagedllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "pagedllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "pagedllm:e2e_request_latency_seconds": "Histogram of end to end request latency in seconds.",
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
    if isinstance(metric, Counter):
        return metric.name, "counter"
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
    if isinstance(metric, (Counter, Gauge)):
        return [f"{metric.name}{_labels(labels)} {_number(metric.value)}"]
    return []


def render(metrics: list[Metric]) -> str:
    families: dict[str, tuple[str, list[str]]] = {}
    for metric in metrics:
        name, kind = _family(metric)
        families.setdefault(name, (kind, []))[1].extend(_samples(metric))
    lines = []
    for name, (kind, samples) in families.items():
        lines.append(f"# HELP {name} {_HELP.get(name, name)}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples)
    return "\n".join(lines) + "\n"
