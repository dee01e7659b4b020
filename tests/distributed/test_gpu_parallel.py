"""Tensor and pipeline parallelism on GPUs (NCCL, the one-shot all-reduce, CUDA graphs on every rank, each pipeline
stage replaying its own layers): TP=2, PP=2, TP=4, TP=2 x PP=2 and PP=4 give the greedy tokens of one GPU, float32
compute, on a tiny Llama whose 2 KV heads are split at TP=2 and replicated at TP=4; every rank replays decode graphs
(5 requests: padded batches, 3 rows in the graph of 4 with two stages). Layouts needing more GPUs than the machine
has are skipped. The draft-model proposer over TP=2 and PP=2 too."""

from __future__ import annotations

import operator
import time

import numpy as np
import pytest
import torch
from tiny_models import save_tiny_decoder
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
)
ENGINE = dict(
    dtype="float32",
    skip_tokenizer_init=True,
    block_size=16,
    kv_cache_memory_bytes=1 << 26,
    compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
)
LAYOUTS = [(2, 1), (1, 2), (4, 1), (2, 2), (1, 4)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    _, path = save_tiny_decoder("llama-gpu-parallel", LlamaConfig, LlamaForCausalLM, MODEL, tmp_path_factory)
    gen = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(0, 512, (k,), generator=gen).tolist()} for k in (5, 40, 17, 1, 63)]
    return path, prompts, _generate(path, (1, 1), prompts)[0]


def _generate(path: str, layout: tuple[int, int], prompts: list[dict]) -> tuple[list, list[int]]:
    """(tokens and logprobs of each output, each rank's decode-graph replays; none with one GPU)."""
    tp, pp = layout
    start = time.monotonic()
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    print(f"tp={tp} pp={pp}: engine up in {time.monotonic() - start:.1f} s", flush=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts, params, use_tqdm=False)
        replays = []
        if tp * pp > 1:
            replays = llm.llm_engine.core.executor._call("apply", operator.attrgetter("graphs.num_replays"))
        got = [(c.token_ids, [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]) for o in outs for c in o.outputs]
        return got, replays
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"tp{t[0]}-pp{t[1]}")
def test_layout_equals_one_gpu(layout, reference):
    if torch.cuda.device_count() < layout[0] * layout[1]:
        pytest.skip(f"needs {layout[0] * layout[1]} GPUs")
    path, prompts, want = reference
    got, replays = _generate(path, layout, prompts)
    assert len(replays) == layout[0] * layout[1] and min(replays) > 0, f"a rank replayed no graph: {replays}"
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(lps, want_lps, atol=1e-3, rtol=0)


def _sample_plain(path: str, tp: int, prompts: list[dict]) -> list[list[int]]:
    """Plain requests (greedy, seeded and unseeded temperatures: no logprobs or filters), sampled by every rank over
    its slice of the vocabulary (sample/vocab_race.py)."""
    llm = LLM(path, tensor_parallel_size=tp, seed=5, **ENGINE)
    try:
        executor = llm.llm_engine.core.executor
        if tp > 1:  # each rank's slice of the vocabulary (an AttributeError where a rank does not race)
            assert sum(executor._call("apply", operator.attrgetter("race.head.num_rows"))) == MODEL["vocab_size"]
        else:
            assert executor.runner.race is not None
        params = [
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=21, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
        ]
        outs = llm.generate(prompts[:3], params, use_tqdm=False)
        return [c.token_ids for o in outs for c in o.outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("tp", [2, 4])
def test_plain_sampling_over_vocabulary_slices_equals_one_gpu(tp, reference):
    """Greedy, seeded and (with the engine's seed) unseeded draws: the same tokens at every tensor-parallel size."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    path, prompts, _ = reference
    assert _sample_plain(path, tp, prompts) == _sample_plain(path, 1, prompts)


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda t: f"tp{t[0]}-pp{t[1]}")
def test_draft_model_over_ranks_equals_one_gpu(layout, reference):
    """The driver's draft model (the target itself) replays its graphs and broadcasts its drafts (NCCL) to its
    tensor-parallel peers: the greedy tokens of one GPU without speculation, the drafts all accepted."""
    if torch.cuda.device_count() < layout[0] * layout[1]:
        pytest.skip(f"needs {layout[0] * layout[1]} GPUs")
    path, prompts, want = reference
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    llm = LLM(path, tensor_parallel_size=layout[0], pipeline_parallel_size=layout[1], speculative_config=spec, **ENGINE)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        sched = llm.llm_engine.core.scheduler
        assert sched.num_draft_tokens > 0 and sched.num_accepted_tokens >= 0.9 * sched.num_draft_tokens
        assert llm.llm_engine.core.executor.runner.drafter.graphs.num_replays > 0
    finally:
        llm.llm_engine.shutdown()
    assert [c.token_ids for o in outs for c in o.outputs] == [tokens for tokens, _ in want]
