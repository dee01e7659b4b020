"""LLM.get_metrics(): token and request counters, latency histograms and gauges, counted from the outputs."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams


def by_name(llm: LLM) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        key = m.name if m.name != "pagedllm:request_success_total" else (m.name, m.labels["finished_reason"])
        out[key] = m
    return out


def test_counters_and_histograms_follow_the_outputs(smollm2):
    llm = LLM(smollm2, dtype="float32", kv_cache_memory_bytes=64 << 20)
    prompts = ["The capital of France is", "Count: 1, 2, 3,", "Hello"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    two = llm.generate("Tell me a joke.", SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]  # fmt: skip
    outs.append(two)
    m = by_name(llm)
    assert m["pagedllm:prompt_tokens_total"].value == sum(len(o.prompt_token_ids) for o in outs)
    assert m["pagedllm:generation_tokens_total"].value == sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert m[("pagedllm:request_success_total", "length")].value == 4
    assert m[("pagedllm:request_success_total", "stop")].value == 0
    assert m["pagedllm:time_to_first_token_seconds"].count == 4
    assert m["pagedllm:e2e_request_latency_seconds"].count == 4
    # one interval per step after the first token: 4 per 5-token request, 3 for the n=2 request (sequences share steps)
    assert m["pagedllm:inter_token_latency_seconds"].count == 3 * 4 + 3
    e2e = m["pagedllm:e2e_request_latency_seconds"]
    assert e2e.sum >= m["pagedllm:time_to_first_token_seconds"].sum > 0
    assert m["pagedllm:num_requests_running"].value == 0
    assert m["pagedllm:num_requests_waiting"].value == 0
    assert m["pagedllm:kv_cache_usage_perc"].value == 0.0
    assert all(metric.labels["model_name"] == smollm2 for metric in llm.get_metrics())
