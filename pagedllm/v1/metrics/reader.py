"""vLLM's `vllm.v1.metrics.reader` import path: the metric types `LLM.get_metrics()` returns."""

from pagedllm.metrics import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
