"""Draft verification end to end on the bundled SmolLM2 (float32, CPU), with a proposer replaying the outputs of a
run without drafts (some drafts corrupted): the same tokens, text, finish reasons and logprobs as without drafts,
greedy and seeded, with stop strings, stop tokens, max_tokens, prefix caching, chunked prefill, preemption and
n > 1; penalized requests verify drafts too (the penalties at a draft position count the drafts before it)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.spec_decode import ReplayProposer

pytestmark = pytest.mark.slow  # the real model end to end; the fast tier covers the engine and the runner alone

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time, in a land far away,",
]
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    "greedy, logprobs, eos": SamplingParams(temperature=0, max_tokens=20, logprobs=2),
    "seeded n=2, logprobs": SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=5, max_tokens=12, logprobs=1),
    "min_tokens, stop tokens": SamplingParams(temperature=0, max_tokens=14, min_tokens=3, stop_token_ids=[28, 30]),
}


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, dtype="float32", kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def small_llm(smollm2):
    # 5 blocks of 16 tokens for 4 requests of up to ~30 tokens: preemption; 16-token budget: chunked prefill
    return LLM(smollm2, dtype="float32", num_gpu_blocks_override=5, max_num_batched_tokens=16)


def run(llm: LLM, prompts, params, proposer=None):
    config = llm.llm_engine.config
    config.speculative_proposer = proposer
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        config.speculative_proposer = None


def replay(outputs, corrupt_every: int) -> ReplayProposer:
    recorded = [o.prompt_token_ids + c.token_ids for o in outputs for c in o.outputs]
    return ReplayProposer(recorded, num_drafts=3, vocab_size=49152, corrupt_every=corrupt_every, seed=2)


def exact(outputs) -> list:
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason, [sorted(d) for d in c.logprobs or []])
        for o in outputs
        for c in o.outputs
    ]


def floats(outputs) -> list[float]:
    """The logprob values: a step with drafts attends over several query tokens, so the last bits may differ."""
    return [lp.logprob for o in outputs for c in o.outputs for d in c.logprobs or [] for lp in d.values()]


def assert_same(outputs, reference) -> None:
    assert exact(outputs) == exact(reference)
    assert floats(outputs) == pytest.approx(floats(reference), abs=1e-4)


def accepted(llm: LLM) -> tuple[int, int]:
    sched = llm.llm_engine.core.scheduler
    return sched.num_accepted_tokens, sched.num_draft_tokens


@pytest.mark.parametrize("case", CASES)
def test_outputs_with_drafts_equal_outputs_without(llm, case):
    params = CASES[case]
    reference = run(llm, PROMPTS, params)
    before = accepted(llm)
    proposer = replay(reference, corrupt_every=4)
    assert_same(run(llm, PROMPTS, params, proposer), reference)
    num_accepted, num_drafts = (a - b for a, b in zip(accepted(llm), before))
    assert 0 < num_accepted < num_drafts  # drafts were accepted, and the corrupted ones rejected


def test_a_stop_string_inside_accepted_drafts(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = run(llm, PROMPTS, params)
    stop_params = params.clone()
    stop_params.stop = [reference[0].outputs[0].text[5:8], reference[2].outputs[0].text[6:9]]
    expected = run(llm, PROMPTS, stop_params)
    assert_same(run(llm, PROMPTS, stop_params, replay(reference, corrupt_every=0)), expected)
    assert {c.finish_reason for o in expected for c in o.outputs} == {"stop", "length"}


def test_drafts_beside_penalized_requests_and_prefix_caching(llm):
    prefix = "You are a helpful assistant. Answer briefly and precisely, in plain words. Question: "
    prompts = [prefix + p for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    params = [greedy, penalized, greedy, penalized]
    reference = run(llm, prompts, params)
    hits = llm.llm_engine.core.scheduler.kv.num_hits
    assert_same(run(llm, prompts, params, replay(reference, corrupt_every=3)), reference)
    assert llm.llm_engine.core.scheduler.kv.num_hits > hits


def test_preemption_and_chunked_prefill(small_llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = run(small_llm, PROMPTS, params)
    preemptions = small_llm.llm_engine.core.scheduler.num_preemptions
    assert preemptions > 0
    assert_same(run(small_llm, PROMPTS, params, replay(reference, corrupt_every=3)), reference)
    assert small_llm.llm_engine.core.scheduler.num_preemptions > preemptions


def test_ngram_drafts_with_stop_strings(llm):
    """The n-gram proposer of speculative_config on prompts that ask to copy their text: drafts are accepted, and the
    outputs (cut by a stop string inside the copied text) are those without drafts."""
    from pagedllm.spec_decode import NgramProposer, SpeculativeConfig

    text = "The red fox jumps over the lazy dog near the river bank, and the dog sleeps in the warm sun all day."
    prompts = [f"Repeat this sentence exactly: {text}\nRepeated: ", f"Copy: {text} {text}\nCopy: "]
    params = SamplingParams(temperature=0, max_tokens=40, stop=["warm sun"])
    reference = run(llm, prompts, params)
    assert "stop" in {c.finish_reason for o in reference for c in o.outputs}
    before = accepted(llm)
    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2)
    assert_same(run(llm, prompts, params, NgramProposer(config)), reference)
    num_accepted, num_drafts = (a - b for a, b in zip(accepted(llm), before))
    assert 0 < num_accepted <= num_drafts
