"""Data parallelism for offline jobs: LLM(data_parallel_size=2) splits a call's prompts between this process and a
replica process, and gives the outputs of one replica, in input order: greedy tokens and logprobs, and seeded
sampling with one SamplingParams per prompt. Bad sizes are refused by name; the server takes -dp but refuses
more than one replica."""

from __future__ import annotations

import argparse
import subprocess

import numpy as np
import pytest
import torch
import transformers as T
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.data_parallel import ProcessReplica, split_evenly
from pagedllm.entrypoints.openai.cli_args import add_serve_parser

BASE = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, block_size=4)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    _, path = save_tiny_decoder("llama-dp", T.LlamaConfig, T.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory)
    return path


def _prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    return [
        {"prompt_token_ids": torch.randint(0, 320, (int(n),), generator=gen).tolist()} for n in (3, 9, 1, 17, 6, 12)
    ]


def _run(llm: LLM) -> tuple[list, list]:
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=100 + i) for i in range(6)]
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    sampled = llm.generate(prompts, seeded, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]  # input order
    greedy_rows = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return greedy_rows, [o.outputs[0].token_ids for o in sampled]


def test_dp2_matches_one_replica(tiny_llama):
    expected_greedy, expected_sampled = _run(LLM(tiny_llama, **BASE))
    llm = LLM(tiny_llama, data_parallel_size=2, **BASE)
    try:
        (replica,) = llm.data_parallel.replicas
        assert isinstance(replica, ProcessReplica) and replica.proc.poll() is None
        greedy, sampled = _run(llm)
        bad = [*_prompts()[:3], {"prompt_token_ids": [1] * 300}]  # the last, replica 1's, exceeds max_model_len
        with pytest.raises(ValueError, match="max_model_len") as info:
            llm.generate(bad, SamplingParams(max_tokens=2), use_tqdm=False)
        assert "in data-parallel replica 1" in "".join(info.value.__notes__)
        with pytest.raises(ValueError, match="sampling_params has 2 entries but there are 6 prompts"):
            llm.generate(_prompts(), [SamplingParams()] * 2, use_tqdm=False)
        # both replicas still serve; the prompts now hit the prefix cache, so the rows batch differently and the
        # float32 logprobs may move in their last bits (4.8e-7 seen): the same tolerance as against one replica
        assert_same_greedy(_run(llm)[0], greedy)
    finally:
        llm.data_parallel.shutdown()
    assert replica.proc.poll() is not None  # the replica process ended
    assert sampled == expected_sampled
    assert_same_greedy(greedy, expected_greedy)


def assert_same_greedy(greedy: list, expected: list) -> None:
    """The same tokens and top-2 ids at every step, logprobs within 1e-5 (float32 sums in another order)."""
    assert len(greedy) == len(expected)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(greedy, expected):
        assert tokens == ref_tokens
        for step, ref_step in zip(logprobs, ref_logprobs):
            assert step.keys() == ref_step.keys()
            got = [step[t].logprob for t in ref_step]
            np.testing.assert_allclose(got, [ref_step[t].logprob for t in ref_step], atol=1e-5, rtol=0)


def test_split_is_contiguous_and_even():
    assert split_evenly(6, 2) == [range(0, 3), range(3, 6)]
    assert split_evenly(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_evenly(1, 2) == [range(0, 1), range(1, 1)]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_bad_data_parallel_size_is_refused(tiny_llama, bad):
    with pytest.raises(ValueError, match=rf"data_parallel_size={bad!r} must be an integer >= 1"):
        LLM(tiny_llama, data_parallel_size=bad, **BASE)


def test_parallel_flags_and_server_refusal():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "-tp", "2", "-pp", "3", "-dp", "4"])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (2, 3, 4)
    assert parser.parse_args(["serve", "m", "--data-parallel-size", "2"]).data_parallel_size == 2
    with pytest.raises(ValueError, match=r"--data-parallel-size=4: the server runs one engine \(allowed: 1\)"):
        args.func(args)


@pytest.mark.slow
def test_dp2_embed_matches_one_replica(tiny_llama):
    prompts = _prompts()
    expected = [o.outputs.embedding for o in LLM(tiny_llama, task="embed", **BASE).embed(prompts, use_tqdm=False)]
    llm = LLM(tiny_llama, task="embed", data_parallel_size=2, **BASE)
    try:
        got = llm.embed(prompts, use_tqdm=False)
    finally:
        llm.data_parallel.shutdown()
    assert [o.prompt_token_ids for o in got] == [p["prompt_token_ids"] for p in prompts]
    np.testing.assert_allclose([o.outputs.embedding for o in got], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("gone_before_first_message", [False, True])
def test_a_replica_that_cannot_start_fails_the_llm(tiny_llama, monkeypatch, gone_before_first_message):
    monkeypatch.setenv("PYTHONHOME", "/nonexistent")  # the replica's interpreter cannot start; this one runs on
    if gone_before_first_message:  # the replica exits before its arguments are sent: the send meets a broken pipe
        real_popen = subprocess.Popen

        def popen_and_wait(*args, **kwargs):
            proc = real_popen(*args, **kwargs)
            proc.wait()
            return proc

        monkeypatch.setattr(subprocess, "Popen", popen_and_wait)
    with pytest.raises(RuntimeError, match=r"data-parallel replica \(pid \d+\) exited with code 1"):
        LLM(tiny_llama, data_parallel_size=2, **BASE)
