"""N-gram speculative decoding end to end on a tiny random Llama (float32, CPU): the outputs with
speculative_config are the outputs without it, token for token (greedy; seeded sampling draws each position by
(seed, position), so it too), over several batch compositions, with logprobs, penalties, n > 1, stop tokens,
max_tokens, prefix caching, chunked prefill and preemption. The prompts repeat themselves, and a random model's greedy
output falls into cycles: each case asserts that drafts were proposed and some accepted (never a vacuous pass)."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [
    [5, 17, 33, 101, 7] * 6,
    list(range(40, 80)) * 2,
    [9, 8, 7],
    [200, 201, 202, 203, 200, 201, 202, 203, 150, 151, 200, 201],
    [11, 12] * 12,
    list(range(100, 140)),
]
BATCHES = {"one": [0], "three": [0, 1, 2], "six": [0, 1, 2, 3, 4, 5], "short first": [2, 5, 3]}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_decoder(
        "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )[1]


def make_llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 22)
    return LLM(path, dtype="float32", skip_tokenizer_init=True, block_size=4, speculative_config=SPEC, **kwargs)


@pytest.fixture(scope="module")
def llm(path):
    return make_llm(path)


@pytest.fixture(scope="module")
def peaked_llm(tmp_path_factory):
    """A model whose next-token distributions are peaked (its output layer scaled up): sampled tokens then follow
    its cycles often enough for sampled drafts to be accepted."""
    hf, path = save_tiny_decoder(
        "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )
    with torch.no_grad():
        hf.lm_head.weight.mul_(20)
    hf.save_pretrained(path)
    return make_llm(path)


def run(llm: LLM, prompts, params, speculate: bool):
    """The outputs, with the engine's n-gram proposer or without any, and the (drafts, accepted) it verified."""
    config, sched = llm.llm_engine.config, llm.llm_engine.core.scheduler
    proposer, before = config.speculative_proposer, (sched.num_draft_tokens, sched.num_accepted_tokens)
    if not speculate:
        config.speculative_proposer = None
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        config.speculative_proposer = proposer
    counts = (sched.num_draft_tokens - before[0], sched.num_accepted_tokens - before[1])
    return outputs, counts


def exact(outputs) -> list:
    return [
        (c.token_ids, c.finish_reason, c.stop_reason, [sorted(d) for d in c.logprobs or []])
        for o in outputs
        for c in o.outputs
    ]


def floats(outputs) -> list[float]:
    return [lp.logprob for o in outputs for c in o.outputs for d in c.logprobs or [] for lp in d.values()]


def assert_same_with_drafts(llm: LLM, prompts, params) -> tuple[int, int]:
    reference, none = run(llm, prompts, params, speculate=False)
    assert none == (0, 0)
    outputs, (num_drafts, num_accepted) = run(llm, prompts, params, speculate=True)
    assert exact(outputs) == exact(reference)
    assert floats(outputs) == pytest.approx(floats(reference), abs=1e-4)
    assert 0 < num_accepted <= num_drafts  # drafts were proposed and some accepted
    return num_drafts, num_accepted


@pytest.mark.parametrize("batch", BATCHES)
def test_greedy_outputs_equal_outputs_without_drafts(llm, batch):
    prompts = [PROMPTS[i] for i in BATCHES[batch]]
    assert_same_with_drafts(llm, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2))


def test_mixed_max_tokens_and_stop_tokens(llm):
    reference, _ = run(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), speculate=False)
    stop = reference[0].outputs[0].token_ids[12]  # inside the cycle the drafts predict
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 7, 40, 33, 5)]
    params[0] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    outputs, _ = run(llm, PROMPTS, params, speculate=True)
    assert [len(o.outputs[0].token_ids) for o in outputs][1:] == [2, 7, 40, 33, 5]  # never past max_tokens
    assert_same_with_drafts(llm, PROMPTS, params)
    assert outputs[0].outputs[0].finish_reason == "stop" and outputs[0].outputs[0].token_ids[-1] == stop


def test_seeded_sampling_with_penalties_and_n_is_reproducible_and_equal(peaked_llm):
    params = SamplingParams(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        min_p=0.02,
        seed=11,
        max_tokens=30,
        ignore_eos=True,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logprobs=1,
    )  # fmt: skip (the frequency penalty at a draft position counts the drafts before it: a wrong count shows)
    prompts = PROMPTS[:4]
    assert_same_with_drafts(peaked_llm, prompts, params)
    first, _ = run(peaked_llm, prompts, params, speculate=True)
    again, _ = run(peaked_llm, prompts, params, speculate=True)
    assert exact(first) == exact(again)


def test_prefix_caching_caches_only_accepted_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference, _ = run(llm, PROMPTS[:3], params, speculate=False)
    continued = [o.prompt_token_ids + o.outputs[0].token_ids for o in reference]  # prompts over generated blocks
    run(llm, PROMPTS[:3], params, speculate=True)  # caches the blocks its accepted tokens filled
    hits = llm.llm_engine.core.scheduler.kv.num_hits
    assert_same_with_drafts(llm, continued, params)
    assert llm.llm_engine.core.scheduler.kv.num_hits > hits


def test_preemption_and_chunked_prefill(path):
    # 24 blocks of 4 tokens for 6 requests of up to 110 tokens: preemption; a 32-token budget: chunked prefill
    small = make_llm(path, num_gpu_blocks_override=40, max_num_batched_tokens=32, kv_cache_memory_bytes=None)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    preemptions = small.llm_engine.core.scheduler.num_preemptions
    assert_same_with_drafts(small, PROMPTS, params)
    assert small.llm_engine.core.scheduler.num_preemptions > preemptions


def test_metrics(llm):
    _, (num_drafts, num_accepted) = run(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=30), True)
    metrics = {m.name: getattr(m, "values", None) or m.value for m in llm.get_metrics() if "spec_decode" in m.name}
    sched = llm.llm_engine.core.scheduler
    assert metrics["vllm:spec_decode_num_draft_tokens"] == sched.num_draft_tokens > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == sched.num_accepted_tokens > 0
    assert metrics["vllm:spec_decode_num_drafts"] == sched.num_drafts > 0
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == sched.num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)


def test_no_spec_metrics_without_speculation(path):
    plain = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
    assert not [m for m in plain.get_metrics() if "spec_decode" in m.name]
    assert plain.llm_engine.config.speculative_proposer is None
