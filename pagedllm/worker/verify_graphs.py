"""CUDA graphs of speculative verify steps, and the choice of graph for a step.

A verify step feeds each decoding request its last token and its drafts: K + 1 tokens per row (fewer where a row has
fewer drafts). Eagerly its ~500 kernel launches cost more than reading the weights, so such steps replay a graph of
q_len = K + 1 tokens per row (worker/cuda_graphs.py: rows with fewer tokens are padded on the left), captured per
batch size like the decode graphs and in their memory pool. Sizes above disable_by_batch_size (where drafts switch
off) or whose tokens exceed max_num_batched_tokens are not captured."""

from __future__ import annotations

import numpy as np

from pagedllm.lora.mapping import StaticLoRAMapping
from pagedllm.worker.cuda_graphs import CudaGraphRunner, stage_input


def verify_sizes(decode_sizes: list[int], q_len: int, max_num_batched_tokens: int, disable_above: int | None):
    """The decode sizes a verify graph is kept for: up to the first that holds disable_above rows (None: all), and
    q_len tokens per row within max_num_batched_tokens."""
    sizes = [s for s in decode_sizes if s * q_len <= max_num_batched_tokens]
    if disable_above is not None:
        cap = next((s for s in sizes if s >= disable_above), None)
        sizes = [s for s in sizes if cap is None or s <= cap]
    return sizes


def make_verify_graphs(runner, decode: CudaGraphRunner | None) -> CudaGraphRunner | None:
    """The verify-step graphs of a runner whose target has decode graphs and speculative decoding on, else None."""
    spec = runner.config.speculative_config
    if decode is None or spec is None:
        return None
    q_len = spec.num_speculative_tokens + 1
    sched = runner.config.scheduler
    sizes = verify_sizes(decode.sizes, q_len, sched.max_num_batched_tokens, spec.disable_by_batch_size)
    if not sizes:
        return None
    lora = None
    if runner.lora is not None:
        lora = StaticLoRAMapping(max(sizes) * q_len, runner.lora.config.max_loras, runner.device)
    return CudaGraphRunner(
        runner.model, runner.backend, sizes, decode.max_blocks, runner.block_size, runner.max_model_len,
        runner.num_kv_heads, runner.device, lora, runner.config.compilation.lazy_cudagraph_capture, q_len,
        intermediate=stage_input(runner),
    )  # fmt: skip


def pick_graph(decode: CudaGraphRunner | None, verify: CudaGraphRunner | None, query_lens: np.ndarray):
    """(graph runner, padded batch size, query_lens for the runner) of a step whose rows have query_lens [num_reqs]
    tokens: one token each -> the decode graphs; at most q_len each -> the verify graphs; None: run eagerly."""
    n = len(query_lens)
    if not n:
        return None
    longest = int(query_lens.max())
    if longest == 1 and decode is not None:
        bs = decode.padded_size(n)
        if bs is not None:
            return decode, bs, None
    if verify is not None and longest <= verify.q_len:
        bs = verify.padded_size(n)
        if bs is not None:
            return verify, bs, query_lens
    return None
