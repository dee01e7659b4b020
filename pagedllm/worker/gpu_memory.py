"""KV-cache sizing on a GPU by profiling: one dummy forward at max_num_batched_tokens plus a sampler pass at
max_num_seqs rows gives the peak activation memory; the cache gets what gpu_memory_utilization leaves after the
weights, that peak, the memory outside torch's allocator (CUDA context, libraries) and the CUDA-graph pool."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from pagedllm.attention.common import BatchLayout
from pagedllm.forward_context import forward_context
from pagedllm.sample.logits_processors import Penalties
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

_GiB = float(1 << 30)
GRAPH_OVERHEAD_BYTES = 4 << 20  # per captured graph: the driver's own memory for the instantiated graph


@contextmanager
def _temporary_kv_cache(runner, num_blocks: int) -> Iterator[None]:
    """One small cache shared by every attention layer while profiling (the real one is not allocated yet)."""
    m = runner.config.model
    cache = runner.backend.allocate_kv_cache(
        num_blocks, runner.block_size, runner.num_kv_heads, m.head_dim, runner.kv_cache_dtype, runner.device
    )  # in the backend's own layout
    for layer in runner.attn_layers:
        layer.kv_cache, layer.backend = cache, runner.backend
    try:
        yield
    finally:
        for layer in runner.attn_layers:
            layer.kv_cache = None


def _dummy_prefill(runner, lens: np.ndarray, num_blocks: int) -> torch.Tensor:
    """A forward over len(lens) prompts of the given lengths, all in the same blocks; hidden [num_tokens, hidden]."""
    bs, dev = runner.block_size, runner.device
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    positions = np.concatenate([np.arange(n) for n in lens])  # [num_tokens]
    table = np.tile(np.arange(num_blocks, dtype=np.int64), (len(lens), 1))  # [num_reqs, num_blocks]
    slots = torch.from_numpy(table[0][positions // bs] * bs + positions % bs).to(dev)  # [num_tokens]
    layout = BatchLayout(cu, lens.astype(np.int64), table, slots, bs, dev)
    with forward_context(runner.backend.build_metadata(layout)):
        ids = torch.zeros(len(positions), dtype=torch.int64, device=dev)  # [num_tokens]
        return runner.forward(ids, torch.from_numpy(positions).to(dev))


def _dummy_sample(runner, hidden: torch.Tensor, num_rows: int) -> None:
    """LM head, logprobs, and the sampler with penalties (the GPU kernel's penalized copies of the rows and their
    tables of counts), top-k and top-p (its scratch lists of candidates) and the most logprobs on every row."""
    if hidden is None:  # a later pipeline stage: the first stage computes the logits
        return
    rows = torch.arange(num_rows, device=runner.device) % hidden.shape[0]  # [num_rows]
    logits = runner.model.compute_logits(hidden[rows])  # [num_rows, vocab] float32
    torch.log_softmax(logits, dim=-1)
    _sample_rules(runner, torch.randn_like(logits))  # no token stands out: top-p's nucleus is wide


def _sample_rules(runner, flat: torch.Tensor) -> None:
    """The sampler over logits [num_rows, vocab] float32 with penalties on every row, top-k, top-p and the most
    logprobs."""
    dev, (num_rows, vocab) = runner.device, flat.shape
    one = np.ones(num_rows, dtype=np.float32)
    meta = SamplingMetadata.build(
        one,
        np.full(num_rows, max(1, vocab - 1), dtype=np.int64),
        np.full(num_rows, 0.99, dtype=np.float32),
        np.full(num_rows, 1e-6, dtype=np.float32),
        device=dev,
        penalties=Penalties(
            np.arange(num_rows),
            np.zeros((num_rows, 1), dtype=np.int64),
            np.zeros(num_rows, dtype=np.int64),
            np.ones(num_rows, dtype=np.int64),
            one,
            one,
            one,
        ),  # fmt: skip
        num_top=np.full(num_rows, MAX_LOGPROBS),
        impl=runner.sampler.impl,
    )
    runner.sampler.rules(flat, meta)


def _peak_of(fn) -> int:
    """Peak bytes that fn allocates on top of what is allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def profile_batch(runner) -> tuple[np.ndarray, int]:
    """The profile's prompts: (lengths [num_reqs] summing to max_num_batched_tokens (at most max_num_seqs x
    max_model_len), the blocks of the longest)."""
    sched = runner.config.scheduler
    num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * runner.max_model_len)
    num_reqs = min(sched.max_num_seqs, num_tokens)
    lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)  # [num_reqs]
    lens[: num_tokens % num_reqs] += 1
    return lens, -(-int(lens.max()) // runner.block_size)


def _graph_runners(runner) -> list:
    """The runner's CUDA-graph runners that share the decode graphs' pool (decode, speculative verify)."""
    return [g for g in (runner.graphs, getattr(runner, "verify_graphs", None)) if g is not None]


@torch.inference_mode()
def profile_peak_memory(runner) -> tuple[int, int]:
    """(peak bytes of a forward at max_num_batched_tokens + sampling at max_num_seqs rows,
    peak bytes of an eager forward at the largest CUDA-graph size (decode or verify), 0 without graphs)."""
    sched = runner.config.scheduler
    lens, num_blocks = profile_batch(runner)
    with _temporary_kv_cache(runner, num_blocks):
        peak = _peak_of(lambda: _dummy_sample(runner, _dummy_prefill(runner, lens, num_blocks), sched.max_num_seqs))
        graph_peak = 0
        for g in _graph_runners(runner):  # (one pool: the largest graph's peak)
            g.clear_inputs()
            graph_peak = max(graph_peak, _peak_of(lambda g=g: g.forward_eager(g.max_size)))
    torch.cuda.empty_cache()
    return peak, graph_peak


def available_kv_cache_bytes(runner) -> int:
    """gpu_memory_utilization * total - weights - peak activations - memory outside torch - CUDA-graph reserve;
    a ValueError naming the numbers when that does not hold one sequence of max_model_len tokens."""
    dev = runner.device
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(dev)  # weights, rotary tables, the runner's static buffers
    peak, graph_peak = profile_peak_memory(runner)
    encoder_reserve = 0
    # a vision encoder's peak (not at the same time as the LM's) and its output cache, where the encoder is (the
    # first pipeline stage)
    if runner.mm is not None and (runner.stage is None or runner.stage.is_first):
        peak = max(peak, _peak_of(runner.mm.profile_encoder))
        encoder_reserve = runner.mm.cache.capacity_bytes
    free, total = torch.cuda.mem_get_info(dev)
    outside = total - free - torch.cuda.memory_reserved(dev)  # CUDA context, library handles, other processes
    graphs = _graph_runners(runner)
    graph_reserve = graph_peak + sum(len(g.sizes) for g in graphs) * GRAPH_OVERHEAD_BYTES if graphs else 0
    util = runner.config.cache.gpu_memory_utilization
    budget = int(util * total)
    kv_bytes = budget - weights - peak - outside - graph_reserve - encoder_reserve
    per_block = runner.kv_bytes_per_block()
    needed = -(-runner.max_model_len // runner.block_size) * per_block
    figures = (
        f"gpu_memory_utilization={util} x {total / _GiB:.2f} GiB = {budget / _GiB:.2f} GiB; weights "
        f"{weights / _GiB:.2f} GiB, peak activations {peak / _GiB:.2f} GiB (max_num_batched_tokens="
        f"{runner.config.scheduler.max_num_batched_tokens}, max_num_seqs={runner.config.scheduler.max_num_seqs}), "
        f"outside torch {outside / _GiB:.2f} GiB, CUDA graphs {graph_reserve / _GiB:.2f} GiB, encoder cache "
        f"{encoder_reserve / _GiB:.2f} GiB"
    )
    if kv_bytes < needed:
        raise ValueError(
            f"the model does not fit: {figures} leave {kv_bytes / _GiB:.2f} GiB for the KV cache, and one sequence "
            f"of max_model_len={runner.max_model_len} tokens needs {needed / _GiB:.3f} GiB. Raise "
            "gpu_memory_utilization, or lower max_model_len, max_num_batched_tokens or max_num_seqs"
        )
    logger.info("KV cache memory %.2f GiB: %s", kv_bytes / _GiB, figures)
    runner.memory_profile = {
        "total_bytes": total,
        "weights_bytes": weights,
        "peak_activation_bytes": peak,
        "outside_torch_bytes": outside,
        "graph_reserve_bytes": graph_reserve,
        "kv_cache_bytes": kv_bytes,
    }
    return kv_bytes
