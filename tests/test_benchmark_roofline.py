"""benchmarks/roofline.py: the FLOP and byte counts of the long-context, vLLM-workload and attention benchmarks,
each against a brute-force count (loops over queries, keys and steps) or a published figure."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import roofline  # noqa: E402


@pytest.mark.parametrize(("query_len", "context_len"), [(1, 0), (5, 0), (3, 7), (1, 1023)])
def test_causal_attention_flops_counts_each_query_key_pair(query_len, context_len):
    layers, heads, dim = 2, 3, 4
    pairs = sum(1 for i in range(query_len) for key in range(context_len + query_len) if key <= context_len + i)
    expected = layers * heads * pairs * (2 * dim + 2 * dim)  # QK^T and PV per (query head, key)
    assert roofline.causal_attention_flops(layers, heads, dim, query_len, context_len) == expected


def test_llama_8b_32k_prefill_flops_match_the_published_mfu():
    """At be16522 a 32k prefill of 1.69 s measured MFU 0.47 on an H100, counting the LM head on every row."""
    attn = roofline.causal_attention_flops(32, 32, 128, 32768)
    body, head = 8030261248 - 2 * 525336576, 525336576
    mfu = (roofline.linear_flops(body, head, 32768, 32768) + attn) / 1.69 / 989e12
    assert mfu == pytest.approx(0.47, abs=0.01)
    assert roofline.linear_flops(body, head, 32768, 1) == 2 * body * 32768 + 2 * head


def test_decode_bytes_sums_weights_and_growing_kv_per_step():
    weights, kv, prompt, steps = 1000, 3, 10, 4
    expected = sum(weights + (prompt + j) * kv for j in range(1, steps + 1))
    assert roofline.decode_bytes(weights, kv, prompt, steps) == expected


def test_batch_roofline_reads_weights_per_step_of_the_longest_output():
    prompts, outputs = [5, 9, 2], [3, 1, 4]
    kv_tokens = sum(p + t for p, n in zip(prompts, outputs) for t in range(n))
    assert roofline.batch_roofline_bytes(100, 2, prompts, outputs) == 100 * 4 + 2 * kv_tokens
    with pytest.raises(ValueError):
        roofline.batch_roofline_bytes(100, 2, [1, 2], [3])


def test_pipeline_stages_read_their_weights_once_per_micro_batch():
    prompts, outputs = [5, 9, 2], [3, 1, 4]
    one_gpu = roofline.batch_roofline_bytes(100, 2, prompts, outputs)
    kv = one_gpu - 100 * 4
    # two stages, each half the weights and half the K/V: weights twice per step (two micro-batches), K/V once
    assert roofline.batch_roofline_bytes(50, 1, prompts, outputs, stages=2) == 2 * 50 * 4 + kv // 2
    # so two stages gain (W + KV) / (W + KV / 2) over one GPU, less than 2
    assert one_gpu / roofline.batch_roofline_bytes(50, 1, prompts, outputs, stages=2) == (400 + kv) / (400 + kv / 2)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Some Future GPU", None),
        ("", None),
    ],
)
def test_dense_bf16_peak_by_device_name(name, peak):
    assert roofline.dense_bf16_peak(name) == peak
