"""The engine's features under tensor parallelism: TP=2 over two CPU processes (gloo, float32) gives the same
tokens and logprobs as one process, with prefix caching, chunked prefill, preemption, n > 1, logprobs, prompt
logprobs, seeded sampling, async scheduling and n-gram speculation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import TINY_DECODER, save_tiny_decoder
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams

ENGINE = dict(dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    _, path = save_tiny_decoder("llama-tp-engine", LlamaConfig, LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory)
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


def _run(path: str, tp: int, params, prompts, **kwargs):
    llm = LLM(path, tensor_parallel_size=tp, **{**ENGINE, **kwargs})
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_equals_one_process(case, llama_path):
    params, kwargs = CASES[case]
    prompts = _prompts()
    if case == "ngram-spec":  # repetitive prompts, so that the proposer finds drafts
        prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, {"prompt_token_ids": [9, 10, 11] * 5}]
    one = _run(llama_path, 1, params, prompts, **kwargs)
    two = _run(llama_path, 2, params, prompts, **kwargs)
    for a, b in zip(one[:2], two[:2]):
        _assert_same(a, b)
    if case == "preemption":
        assert two[2] > 0, "no request was preempted"
    else:
        assert two[1][0].num_cached_tokens >= 4, "the repeated prompt found no cached block"


def test_tp2_prompt_logprobs(llama_path):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    prompts = _prompts(3)
    one = _run(llama_path, 1, params, prompts)[0]
    two = _run(llama_path, 2, params, prompts)[0]
    for a, b in zip(one, two):
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            np.testing.assert_allclose([v.logprob for v in pa.values()], [v.logprob for v in pb.values()], atol=1e-4)


def test_tp_size_checks(llama_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM(llama_path, tensor_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by the tensor-parallel size 3"):
        LLM(llama_path, tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="distributed_executor_backend='uni'"):
        LLM(llama_path, tensor_parallel_size=2, distributed_executor_backend="uni", **ENGINE)
