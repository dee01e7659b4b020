"""The engine's features under tensor and pipeline parallelism: TP=2, PP=2 and TP=2 x PP=2 over CPU processes
(gloo, float32) give the same tokens and logprobs as one process, with prefix caching, chunked prefill, preemption,
n > 1, logprobs, prompt logprobs, seeded sampling, async scheduling and n-gram and draft-model speculation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import TINY_DECODER, save_tiny_decoder
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.layers.build_context import stage_layers

ENGINE = dict(dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    """Three layers (two stages: 2 + 1), tied embeddings."""
    kwargs = dict(TINY_DECODER, num_hidden_layers=3, tie_word_embeddings=True)
    _, path = save_tiny_decoder("llama-tp-engine", LlamaConfig, LlamaForCausalLM, kwargs, tmp_path_factory)
    return path


def _prompts(n: int = 6) -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 40, (n,), generator=gen).tolist()
    return [{"prompt_token_ids": torch.randint(0, 320, (k,), generator=gen).tolist()} for k in lengths]


def _summary(outs) -> list:
    rows = []
    for out in outs:
        for c in out.outputs:
            lps = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)] if c.logprobs else []
            rows.append((c.token_ids, lps))
    return rows


def _run(path: str, layout: tuple[int, int], params, prompts, **kwargs):
    tp, pp = layout
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **{**ENGINE, **kwargs})
    try:
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[:2], params, use_tqdm=False)  # prefix-cache hits
        preempted = llm.llm_engine.core.scheduler.num_preemptions
        return first, again, preempted
    finally:
        llm.llm_engine.shutdown()


def _assert_same(a, b) -> None:
    for (ta, la), (tb, lb) in zip(_summary(a), _summary(b), strict=True):
        assert ta == tb
        np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)


CASES = {
    "greedy-logprobs": (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3), {}),
    "seeded-n2": (SamplingParams(temperature=0.9, top_p=0.9, n=2, seed=3, max_tokens=10, ignore_eos=True), {}),
    "penalties-async": (
        SamplingParams(temperature=0.8, seed=5, presence_penalty=0.5, max_tokens=10, ignore_eos=True, logprobs=1),
        {"async_scheduling": True},
    ),
    # a cache of 24 blocks of 4 tokens for 6 requests of up to 50 tokens: requests are preempted and resumed
    "preemption": (
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
        {"num_gpu_blocks_override": 24},
    ),
    "ngram-spec": (
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}},
    ),
}


QUICK = {("greedy-logprobs", (2, 1)), ("greedy-logprobs", (1, 2)), ("preemption", (1, 2)), ("seeded-n2", (2, 1))}
LAYOUTS = [(2, 1), (1, 2)]
ONE_PROCESS: dict[str, tuple] = {}  # case -> its run in one process


@pytest.mark.parametrize(
    "case, layout",
    [
        pytest.param(c, lay, marks=() if (c, lay) in QUICK else pytest.mark.slow, id=f"{c}-tp{lay[0]}-pp{lay[1]}")
        for c in sorted(CASES)
        for lay in LAYOUTS
    ],
)
def test_parallel_equals_one_process(case, layout, llama_path):
    params, kwargs = CASES[case]
    prompts = _prompts()
    if case == "ngram-spec":  # repetitive prompts, so that the proposer finds drafts
        prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, {"prompt_token_ids": [9, 10, 11] * 5}]
    if case not in ONE_PROCESS:  # (both layouts compare with the same one-process run)
        ONE_PROCESS[case] = _run(llama_path, (1, 1), params, prompts, **kwargs)
    one = ONE_PROCESS[case]
    two = _run(llama_path, layout, params, prompts, **kwargs)
    for a, b in zip(one[:2], two[:2]):
        _assert_same(a, b)
    if case == "preemption":
        assert two[2] > 0, "no request was preempted"
    else:
        assert two[1][0].num_cached_tokens >= 4, "the repeated prompt found no cached block"


@pytest.mark.parametrize("layout", [(2, 1), pytest.param((2, 2), marks=pytest.mark.slow)], ids=str)
def test_prompt_logprobs_and_tp2_pp2(layout, llama_path):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, logprobs=1)
    prompts = _prompts(3)
    one = _run(llama_path, (1, 1), params, prompts)[0]
    two = _run(llama_path, layout, params, prompts)[0]
    _assert_same(one, two)
    for a, b in zip(one, two):
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            np.testing.assert_allclose([v.logprob for v in pa.values()], [v.logprob for v in pb.values()], atol=1e-4)


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=str)
def test_draft_model_over_parallel_ranks(layout, llama_path):
    """The driver's draft model (the target itself: its drafts are the target's tokens) with TP=2 and PP=2 (TP=2 x
    PP=2 passes too, left out: four processes on CI's two cores): the tokens and logprobs of one process without
    speculation, the greedy drafts all accepted. With presence penalties the ranks read the broadcast drafts on the
    host (a penalized request's penalties count them; the draft's greedy tokens then miss the penalized target's more
    often)."""
    spec = {"method": "draft_model", "model": llama_path, "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, *_prompts(3)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=0.5, logprobs=1)
    tp, pp = layout
    llm = LLM(llama_path, tensor_parallel_size=tp, pipeline_parallel_size=pp, speculative_config=spec, **ENGINE)
    try:
        for params in (greedy, penalized):
            sched = llm.llm_engine.core.scheduler
            before = sched.num_draft_tokens, sched.num_accepted_tokens
            got = llm.generate(prompts, params, use_tqdm=False)
            drafts, accepted = sched.num_draft_tokens - before[0], sched.num_accepted_tokens - before[1]
            assert 0 < accepted and (accepted == drafts or params is penalized), (drafts, accepted)
            _assert_same(_run(llama_path, (1, 1), params, prompts)[0], got)
    finally:
        llm.llm_engine.shutdown()


def test_tp_size_checks(llama_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(llama_path, tensor_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by the tensor-parallel size 3"):
        LLM(llama_path, tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="distributed_executor_backend='uni'"):
        LLM(llama_path, tensor_parallel_size=2, distributed_executor_backend="uni", **ENGINE)
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds num_hidden_layers=3"):
        LLM(llama_path, pipeline_parallel_size=4, **ENGINE)


def test_stage_layers_split():
    assert [stage_layers(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [stage_layers(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]


def test_profile_traces_every_rank(llama_path, tmp_path, monkeypatch):
    """LLM.start_profile / stop_profile at TP=2: one trace per rank (each rank profiles itself, in its process), and
    the misuse errors come before any rank is asked (a worker whose call fails ends)."""
    import os

    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    llm = LLM(llama_path, tensor_parallel_size=2, **ENGINE)
    try:
        with pytest.raises(ValueError, match="not running"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(ValueError, match="already running"):
            llm.start_profile()
        llm.generate(_prompts(2), SamplingParams(max_tokens=2), use_tqdm=False)
        llm.stop_profile()
        traces = sorted(f for f in os.listdir(tmp_path) if f.endswith(".pt.trace.json"))
        assert [f.split(".")[0] for f in traces] == ["pagedllm-rank0", "pagedllm-rank1"], traces
        out = llm.generate(_prompts(2), SamplingParams(max_tokens=2), use_tqdm=False)  # the workers live on
        assert all(len(o.outputs[0].token_ids) == 2 for o in out)
    finally:
        llm.llm_engine.shutdown()
