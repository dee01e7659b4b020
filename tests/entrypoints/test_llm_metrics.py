"""LLM.get_metrics(): token and request counters, latency histograms and gauges, counted from the outputs."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams


def by_name(llm: LLM) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        key = m.name if m.name != "vllm:request_success" else (m.name, m.labels["finished_reason"])
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
    assert m["vllm:prompt_tokens"].value == sum(len(o.prompt_token_ids) for o in outs)
    assert m["vllm:generation_tokens"].value == sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert m[("vllm:request_success", "length")].value == 4
    assert m[("vllm:request_success", "stop")].value == 0
    assert m["vllm:time_to_first_token_seconds"].count == 4
    assert m["vllm:e2e_request_latency_seconds"].count == 4
    # one interval per step after the first token: 4 per 5-token request, 3 for the n=2 request (sequences share steps)
    assert m["vllm:inter_token_latency_seconds"].count == 3 * 4 + 3
    e2e = m["vllm:e2e_request_latency_seconds"]
    assert e2e.sum >= m["vllm:time_to_first_token_seconds"].sum > 0
    assert m["vllm:num_requests_running"].value == 0
    assert m["vllm:num_requests_waiting"].value == 0
    assert m["vllm:kv_cache_usage_perc"].value == 0.0
    assert all(metric.labels["model_name"] == smollm2 for metric in llm.get_metrics())
    # per-request histograms: token counts and parameters of the 4 requests, and phases that add up
    prompt_lengths = [len(o.prompt_token_ids) for o in outs]
    assert m["vllm:request_prompt_tokens"].count == 4 and m["vllm:request_prompt_tokens"].sum == sum(prompt_lengths)
    assert m["vllm:request_prompt_tokens"].buckets["5"] == sum(n <= 5 for n in prompt_lengths)
    assert m["vllm:request_generation_tokens"].sum == 3 * 5 + 2 * 4
    assert m["vllm:request_max_num_generation_tokens"].sum == 3 * 5 + 4
    assert m["vllm:request_params_n"].sum == 3 + 2 and m["vllm:request_params_n"].buckets["1"] == 3
    assert m["vllm:request_params_max_tokens"].sum == 3 * 5 + 4
    queue, prefill = m["vllm:request_queue_time_seconds"], m["vllm:request_prefill_time_seconds"]
    decode, inference = m["vllm:request_decode_time_seconds"], m["vllm:request_inference_time_seconds"]
    assert queue.count == prefill.count == decode.count == inference.count == 4
    assert min(queue.sum, prefill.sum, decode.sum) > 0
    ttft = m["vllm:time_to_first_token_seconds"].sum
    assert abs(queue.sum + prefill.sum - ttft) < 1e-9
    assert abs(prefill.sum + decode.sum - inference.sum) < 1e-9
    assert abs(queue.sum + inference.sum - e2e.sum) < 1e-9
    tpot, itl = m["vllm:time_per_output_token_seconds"], m["vllm:inter_token_latency_seconds"]
    assert (tpot.count, tpot.sum, tpot.buckets) == (itl.count, itl.sum, itl.buckets)  # the seed-era name
    assert m["vllm:gpu_cache_usage_perc"].value == m["vllm:kv_cache_usage_perc"].value == 0.0
    assert m["vllm:num_requests_swapped"].value == 0
