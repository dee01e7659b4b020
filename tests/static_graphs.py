"""Runs an engine's CUDA-graph paths without a GPU: the model runner's (and its proposer's) graph runners over their
static buffers, the model eager over them (worker/cuda_graphs.py), with the Triton attention kernels in Triton's
interpreter. The same inputs, metadata and padding a replay reads."""

from __future__ import annotations

import torch

from pagedllm.attention import triton_backend
from pagedllm.spec_decode.draft_model import proposer_graphs
from pagedllm.worker.cuda_graphs import CudaGraphRunner, stage_input

SIZES = [1, 2, 4]

if not torch.cuda.is_available():  # as tests/kernels/conftest.py: the interpreter's scalars index via .item()
    import triton.runtime.interpreter as _interpreter

    _patch = _interpreter._patch_lang_tensor
    if not getattr(_patch, "item_index", False):

        def _patch_lang_tensor_item(tensor, scope):
            _patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

        _patch_lang_tensor_item.item_index = True
        _interpreter._patch_lang_tensor = _patch_lang_tensor_item


def graph_runner(runner, q_len: int) -> CudaGraphRunner:
    """A runner's graph runner of q_len tokens per row, sizes SIZES, on the Triton backend (on a pipeline stage
    after the first, with the static (hidden, residual) input)."""
    max_blocks = -(-runner.max_model_len // runner.block_size)
    args = (runner.model, triton_backend, SIZES, max_blocks, runner.block_size, runner.max_model_len)
    graphs = CudaGraphRunner(*args, runner.num_kv_heads, runner.device, q_len=q_len, intermediate=stage_input(runner))
    graphs.capture_graphs = False  # (on a GPU too: the static buffers, no capture)
    return graphs


def make_static(llm) -> None:
    """Moves an engine (no request run yet) to the Triton backend, its decode and verify steps and its proposer's
    passes (a draft model's or an EAGLE head's) to the graph runners' static buffers."""
    runner = llm.llm_engine.core.executor.runner
    drafter = runner.drafter
    runner.backend = triton_backend
    if drafter is not None:
        drafter.backend = triton_backend
    runner.allocate_kv_cache(llm.llm_engine.config.cache.num_blocks)  # (the proposer's too) in the Triton layout
    spec = llm.llm_engine.config.speculative_config
    runner.graphs = graph_runner(runner, 1)
    runner.verify_graphs = graph_runner(runner, spec.num_speculative_tokens + 1) if spec is not None else None
    if drafter is not None:
        extra = None
        if hasattr(drafter, "tail_logit"):  # an EAGLE head: its hidden states are a static input
            extra = (drafter.model_config.hf_config.hidden_size, drafter.model_config.dtype)
        num_kv_heads = drafter.attn_layers[0].num_kv_heads
        drafter.graphs, drafter.first_graphs = proposer_graphs(drafter, runner.graphs, num_kv_heads, extra)
        drafter.graphs.capture_graphs = drafter.first_graphs.capture_graphs = False


def make_static_ranks(llm) -> None:
    """make_static for every rank of a tensor/pipeline-parallel engine (no proposer): each rank's runner, in the
    workers' processes too (they import this module: tests/ must be on their PYTHONPATH). Each rank's decode
    graph runner records the (padded size, tokens) of its replays (`replays`)."""
    executor = llm.llm_engine.core.executor
    executor._call("apply", static_runner, llm.llm_engine.config.cache.num_blocks)


def static_runner(runner, num_blocks: int) -> None:
    """One rank's runner on the Triton backend, its decode steps through the static buffers, replays recorded."""
    runner.backend = triton_backend
    runner.allocate_kv_cache(num_blocks)
    graphs = runner.graphs = graph_runner(runner, 1)
    graphs.replays, replay = [], graphs.replay

    def recorded(bs: int, num_tokens: int):
        graphs.replays.append((bs, num_tokens))
        return replay(bs, num_tokens)

    graphs.replay = recorded


def recorded_replays(runner) -> list[tuple[int, int]]:
    """The (padded size, tokens) of a static_runner's decode replays so far."""
    return runner.graphs.replays
