"""Verify steps through the CUDA-graph runner's static buffers (worker/cuda_graphs.py, worker/verify_graphs.py).

Without a GPU the runner runs the model eagerly over its static buffers (no capture), with the Triton attention
kernels in Triton's interpreter: the same inputs, metadata and left padding a replay reads. A verify step through that
path must give the logits of the eager path (and HF's greedy tokens), and speculation over it the outputs without.
(On a GPU: tests/spec_decode's gpu tests check that graphs replay verify steps and keep the outputs.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from static_graphs import graph_runner, make_static
from test_spec_decode_runner import PROMPTS, Requests, hf_greedy

from pagedllm import LLM
from pagedllm.attention import triton_backend
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.cuda_graphs import CudaGraphRunner
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.verify_graphs import pick_graph, verify_sizes

pytest.importorskip("triton")
# the runner tests below build CPU runners: their Triton kernels run interpreted (no GPU)
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs without a GPU only")

BLOCK, BLOCKS_PER_REQ = 4, 16
K = 3  # drafts per row: verify graphs of K + 1 tokens per row


def triton_runner(config, static: bool) -> ModelRunner:
    """A CPU runner on the Triton attention backend (interpreted); static: decode and verify steps go through the
    graph runners' static buffers."""
    runner = ModelRunner(config)
    runner.backend = triton_backend
    runner.allocate_kv_cache(4 * BLOCKS_PER_REQ)
    if static:
        runner.graphs, runner.verify_graphs = graph_runner(runner, 1), graph_runner(runner, K + 1)
    return runner


def test_rows_are_padded_on_the_left_and_gathered_back(config):
    """Rows of 1, 4 and 2 tokens in a graph of 4 tokens per row (size 4): each row's tokens end its 4 slots, pad
    tokens write no KV; the fourth row is padding; the flat order comes back."""
    runner = ModelRunner(config)
    g = CudaGraphRunner(runner.model, triton_backend, [2, 4], 8, BLOCK, 64, runner.num_kv_heads, runner.device, q_len=4)
    lens = np.array([1, 4, 2])
    ids = np.array([10, 20, 21, 22, 23, 30, 31])
    slots, positions = ids + 100, ids % 10
    table = np.arange(3 * 8).reshape(3, 8)
    g.load_inputs(4, ids, positions, slots, np.array([5, 9, 7]), table, query_lens=lens)
    assert g.dev_i64[0].tolist() == [0, 0, 0, 10, 20, 21, 22, 23, 0, 0, 30, 31, 0, 0, 0, 0]
    assert g.dev_i64[2].tolist() == [-1, -1, -1, 110, 120, 121, 122, 123, -1, -1, 130, 131, -1, -1, -1, -1]
    assert g.dev_i64[3, :7].tolist() == [3, 4, 5, 6, 7, 10, 11]
    assert g.dev_i32[:4].tolist() == [5, 9, 7, 0]  # the padding row reads no key
    assert g.query_start_loc[:5].tolist() == [0, 4, 8, 12, 16]
    assert g.metas[4].max_query_len == 4 and g.metas[4].num_splits == 1
    # a late input (device) lands in its row's slot
    g.load_inputs(
        4, ids, positions, slots, np.array([5, 9, 7]), table, (torch.tensor([6]), torch.tensor([77])), None, lens
    )
    assert g.dev_i64[0, 11].item() == 77


def test_pick_graph_and_verify_sizes(config):
    runner = ModelRunner(config)
    decode, verify = graph_runner(runner, 1), graph_runner(runner, 4)
    assert pick_graph(decode, verify, np.array([1, 1, 1]))[:2] == (decode, 4)
    picked = pick_graph(decode, verify, np.array([4, 2]))
    assert picked[:2] == (verify, 2) and picked[2].tolist() == [4, 2]
    assert pick_graph(decode, verify, np.array([5, 1])) is None  # a longer row (a prefill chunk): eagerly
    assert pick_graph(decode, verify, np.array([1] * 5)) is None  # above the largest size
    assert verify_sizes([1, 2, 4, 8, 16, 24, 32, 48], 5, 8192, 20) == [1, 2, 4, 8, 16, 24]
    assert verify_sizes([1, 2, 4, 8, 16], 5, 40, None) == [1, 2, 4, 8]


def run_steps(runner: ModelRunner, truth: dict) -> list:
    """The join, then verify steps with drafts of different lengths (right and wrong ones): the outputs."""
    reqs = Requests(runner)
    outs = [reqs.join(PROMPTS, SamplingParams(temperature=0, max_tokens=20, logprobs=2))]
    a, b = truth["a"][0], truth["b"][0]
    outs.append(reqs.step({"a": a[1:4], "b": [b[1]]}))  # 3 and 1 drafts: b padded on the left
    outs.append(reqs.step({"a": [(a[5] + 1) % 320, a[6]], "b": b[3:6]}))  # a: its first draft wrong
    outs.append(reqs.step({}))  # decodes
    return outs


@interpreted
def test_verify_steps_through_static_buffers_equal_eager_and_hf(tiny, config):
    hf, _ = tiny
    truth = {r: hf_greedy(hf, p, 16) for r, p in PROMPTS.items()}
    static = triton_runner(config, static=True)
    outs = run_steps(static, truth)
    assert static.verify_graphs.num_replays == 2 and static.graphs.num_replays == 1
    eager = run_steps(triton_runner(config, static=False), truth)
    for got, ref in zip(outs, eager):
        assert got.sampled_token_ids == ref.sampled_token_ids
        for req_id, entries in ref.logprobs.items():
            for (ids, lps, _), (ref_ids, ref_lps, _) in zip(got.logprobs[req_id], entries):
                assert ids == ref_ids and lps == pytest.approx(ref_lps, abs=1e-5)
    a, b = truth["a"][0], truth["b"][0]
    assert [o.sampled_token_ids["a"] for o in outs] == [a[:1], a[1:5], a[5:6], a[6:7]]
    assert [o.sampled_token_ids["b"] for o in outs] == [b[:1], b[1:3], b[3:7], b[7:8]]


def static_draft_llm(path: str) -> LLM:
    """A CPU engine whose target and draft model (the same tiny model) run every step they can over the graph
    runners' static buffers (Triton attention, interpreted)."""
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, block_size=BLOCK, speculative_config=spec)
    make_static(llm)
    return llm


@interpreted
def test_draft_model_speculation_through_static_buffers_keeps_outputs(tiny):
    """Outputs with a draft model, target verify steps and draft passes over the static buffers, equal the outputs
    without speculation (and the drafts, the target's own greedy tokens, are accepted)."""
    llm = static_draft_llm(tiny[1])
    runner = llm.llm_engine.core.executor.runner
    config, sched = llm.llm_engine.config, llm.llm_engine.core.scheduler
    prompts = [{"prompt_token_ids": p} for p in PROMPTS.values()]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    proposer, config.speculative_proposer = config.speculative_proposer, None
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    config.speculative_proposer = proposer
    counts = [
        runner.verify_graphs.num_replays,
        runner.drafter.graphs.num_replays,
        runner.drafter.first_graphs.num_replays,
    ]
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs == reference
    assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens >= 0.9 * sched.num_draft_tokens
    assert runner.verify_graphs.num_replays > counts[0] and runner.drafter.graphs.num_replays > counts[1]
    assert runner.drafter.first_graphs.num_replays > counts[2]
