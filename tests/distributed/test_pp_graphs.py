"""Pipeline stages replay their decode steps from CUDA graphs (distributed/pipeline.py run_graph,
worker/cuda_graphs.py): on CPU processes (gloo, float32) every rank's decode steps go through its graph runner's
static buffers (the model eager over them, Triton attention interpreted), the later stage's (hidden, residual) through
the static input. PP=2, TP=2 x PP=2 and PP=3 (a middle stage: a static input and static outputs) give the greedy
tokens and logprobs of one process, with decode batches that need padding (3 rows in the graph of 4)."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
from static_graphs import make_static_ranks, recorded_replays
from tiny_models import TINY_DECODER, save_tiny_decoder
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams, engine_args
from pagedllm.attention import triton_backend
from pagedllm.config import ParallelConfig
from pagedllm.worker.cuda_graphs import CudaGraphRunner

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs without a GPU only")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the workers import static_graphs from here
ENGINE = dict(dtype="float32", skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=64)
MAX_TOKENS = [7, 5, 6, 3, 7, 4, 6]  # 7 requests: decode batches of 4 and 3 rows, fewer as they finish


@pytest.fixture(autouse=True)
def patient_peers(monkeypatch):
    """Every rank runs the attention kernels in Triton's interpreter: a step takes seconds, more beside other tests
    on two cores, so a peer waits up to a minute for it (the default 10 s is for hung peers: test_tp_faults.py)."""
    monkeypatch.setattr(engine_args, "ParallelConfig", functools.partial(ParallelConfig, distributed_timeout_s=60.0))


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    """Three layers (two stages: 2 + 1; three: one each)."""
    kwargs = dict(TINY_DECODER, num_hidden_layers=3)
    _, path = save_tiny_decoder("llama-pp-graphs", LlamaConfig, LlamaForCausalLM, kwargs, tmp_path_factory)
    return path


def _prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 12, (len(MAX_TOKENS),), generator=gen).tolist()
    return [{"prompt_token_ids": torch.randint(0, 320, (k,), generator=gen).tolist()} for k in lengths]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in MAX_TOKENS]


def _summary(outs) -> list:
    return [(c.token_ids, [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def one_process(llama_path):
    llm = LLM(llama_path, **ENGINE)
    try:
        return _summary(llm.generate(_prompts(), _params(), use_tqdm=False))
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "layout",
    [(1, 2), pytest.param((2, 2), marks=pytest.mark.slow), pytest.param((1, 3), marks=pytest.mark.slow)],
    ids=str,
)
def test_stage_graphs_equal_one_process(layout, llama_path, one_process, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p))
    tp, pp = layout
    llm = LLM(llama_path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    try:
        make_static_ranks(llm)
        got = _summary(llm.generate(_prompts(), _params(), use_tqdm=False))
        replays = llm.llm_engine.core.executor._call("apply", recorded_replays)
    finally:
        llm.llm_engine.shutdown()
    for (tokens, lps), (want_tokens, want_lps) in zip(got, one_process, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(lps, want_lps, atol=1e-4, rtol=0)
    assert len(replays) == tp * pp
    assert all(r == replays[0] for r in replays), "the ranks replayed different steps"
    assert (4, 3) in replays[0], "no decode batch was padded"


class _Echo(torch.nn.Module):
    """A model that returns the (hidden, residual) it was given: what a stage's graph reads from its static input."""

    def forward(self, input_ids, positions, intermediate):
        return intermediate[0] + 0, intermediate[1] + 0


def test_static_input_takes_the_rows_of_the_flat_batch():
    """Rows of 1, 3 and 2 tokens (a verify graph of 3 tokens per row, size 4; left padding): the received
    (hidden, residual) land in their tokens' rows, the padding rows are zero (also where an earlier step left
    values), and the replay gives them back in the flat order."""
    g = CudaGraphRunner(
        _Echo(), triton_backend, [2, 4], 4, 4, 16, 1, torch.device("cpu"), q_len=3, intermediate=(2, torch.float32)
    )
    lens = np.array([1, 3, 2])
    ids = np.arange(6)
    g.load_inputs(4, ids, ids, ids, np.array([4, 6, 5]), np.zeros((3, 4), dtype=np.int64), query_lens=lens)
    g.intermediate.fill_(7.0)  # an earlier step's values
    pair = torch.arange(24, dtype=torch.float32).view(2, 6, 2)  # [2, num_tokens, hidden]
    g.load_intermediate(4, pair)
    real = [2, 3, 4, 5, 7, 8]  # each token's row in the graph
    assert torch.equal(g.intermediate[:, real], pair)
    padding = [i for i in range(12) if i not in real]
    assert not g.intermediate[:, padding].any()
    hidden, residual = g.replay(4, 6)
    assert torch.equal(hidden, pair[0]) and torch.equal(residual, pair[1])
