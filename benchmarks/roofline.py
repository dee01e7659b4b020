"""The limits the GPU benchmarks compare against: a device's dense bf16 peak (a table by device name), the FLOPs of a
prefill (linear layers and causal attention) and the bytes a decode or a batch of requests must read at least.
Pure functions, no device needed."""

from __future__ import annotations

# dense (not 2:4 sparse) bf16 tensor-core FLOP/s from the vendors' data sheets; the first name found in the device
# name wins, so the specific variants come before the family's default (the SXM part)
DENSE_BF16_PEAK = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def dense_bf16_peak(device_name: str) -> float | None:
    """The device's dense bf16 peak FLOP/s from DENSE_BF16_PEAK, None for a device not in the table."""
    for key, peak in DENSE_BF16_PEAK:
        if key.lower() in device_name.lower():
            return peak
    return None


def causal_attention_flops(num_layers: int, num_heads: int, head_dim: int, query_len: int, context_len: int = 0) -> int:
    """FLOPs of causal attention for query_len new tokens after context_len cached ones: query i (0-based) attends
    to context_len + i + 1 keys, each key costing 2 * head_dim for QK^T and 2 * head_dim for PV per query head:
    4 * layers * heads * head_dim * (query_len * context_len + query_len * (query_len + 1) / 2)."""
    pairs = query_len * context_len + query_len * (query_len + 1) // 2
    return 4 * num_layers * num_heads * head_dim * pairs


def linear_flops(body_params: int, lm_head_params: int, tokens: int, logit_rows: int) -> int:
    """FLOPs of the linear layers: 2 * body_params per token (every weight matrix but the input embedding, a lookup,
    and the LM head) plus 2 * lm_head_params per row that reaches the LM head (one per request in a prefill)."""
    return 2 * body_params * tokens + 2 * lm_head_params * logit_rows


def decode_bytes(step_weight_bytes: int, kv_bytes_per_token: int, prompt_len: int, num_steps: int) -> int:
    """Bytes one request's decode steps read at least: step j (1..num_steps) reads the weights once and the K/V of
    prompt_len + j tokens (the prompt, the j - 1 tokens decoded before and its own)."""
    kv_tokens = num_steps * prompt_len + num_steps * (num_steps + 1) // 2
    return num_steps * step_weight_bytes + kv_tokens * kv_bytes_per_token


def batch_roofline_bytes(
    weight_bytes: int, kv_bytes_per_token: int, prompt_lens: list[int], output_lens: list[int], stages: int = 1
) -> int:
    """Bytes a batch of requests, all running at once, reads at least: the weights once per step (as many steps as
    the longest output) plus, for each request, the K/V of prompt_len + t tokens at its t-th step (t < output_len):
    the bound of benchmarks/gpu_throughput.py's nanovllm-bench roofline.

    With pipeline stages (weight_bytes and kv_bytes_per_token then one stage's), the bound of one stage's GPU: a
    stage idles unless the running requests are split into (at least) `stages` micro-batches, and each micro-batch
    reads the stage's weights again, so every step of the batch reads them `stages` times (the K/V once). Against
    one GPU's bound, S stages gain (W + KV) / (W + KV / S) in decode, not S."""
    kv_tokens = sum(p * n + n * (n - 1) // 2 for p, n in zip(prompt_lens, output_lens, strict=True))
    return stages * weight_bytes * max(output_lens) + kv_tokens * kv_bytes_per_token
