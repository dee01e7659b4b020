"""vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json, and the seed-era panels and
the names the drop-in issue lists): every series its queries read is on /metrics, labelled with the served model
name as the dashboard's `model_name` variable selects it."""

from __future__ import annotations

import re

from conftest import MODEL_NAME

# the series names in the dashboard's PromQL expressions (and the label_values query over {__name__=~"vllm:.*"})
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_swapped",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
# the current names beside the seed-era ones, and the others the issue names
CURRENT_SERIES = [
    "vllm:kv_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_params_n_bucket",
    "vllm:request_params_max_tokens_bucket",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hit_rate",
]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def test_dashboard_series_resolve(server):
    status, _ = server.request("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert status == 200
    status, text = server.request("GET", "/metrics")
    assert status == 200
    labels_of: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            match = _SAMPLE.match(line)
            assert match, line
            labels_of.setdefault(match.group(1), []).append(match.group(2) or "")
    missing = [name for name in DASHBOARD_SERIES + CURRENT_SERIES if name not in labels_of]
    assert missing == []
    for name in DASHBOARD_SERIES:
        assert all(f'model_name="{MODEL_NAME}"' in labels for labels in labels_of[name]), name
    reasons = {re.search(r'finished_reason="(\w+)"', lbl).group(1) for lbl in labels_of["vllm:request_success_total"]}
    assert {"stop", "length", "abort"} <= reasons


def test_metrics_prefix_adds_families():
    """--metrics-prefix pagedllm: every family also under pagedllm:, same values, vllm: untouched."""
    from pagedllm.entrypoints.openai import metrics_text
    from pagedllm.metrics import Counter, HistogramData

    hist = HistogramData()
    hist.observe(0.3)
    found = [Counter("vllm:prompt_tokens", {"model_name": "m"}, 5), hist.to_metric("vllm:e2e_seconds", {})]
    text = metrics_text.render(found + metrics_text.renamed(found, ("pagedllm",)))
    assert 'vllm:prompt_tokens_total{model_name="m"} 5.0' in text
    assert 'pagedllm:prompt_tokens_total{model_name="m"} 5.0' in text
    assert "# TYPE pagedllm:e2e_seconds histogram" in text and 'pagedllm:e2e_seconds_bucket{le="0.5"} 1.0' in text
    assert found[0].name == "vllm:prompt_tokens"  # the originals are not renamed


def test_a_vector_renders_as_a_counter_by_position():
    from pagedllm.entrypoints.openai import metrics_text
    from pagedllm.v1.metrics.reader import Counter, Vector  # vLLM's import path

    found = [Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {"model_name": "m"}, [4, 2]),
             Counter("vllm:request_success", {"finished_reason": "stop"}, 3)]  # fmt: skip
    text = metrics_text.render(found)
    assert "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter" in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text
    assert 'vllm:request_success_total{finished_reason="stop"} 3.0' in text
