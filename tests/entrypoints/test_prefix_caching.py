"""Automatic prefix caching end to end on the bundled SmolLM2 (float32): the same tokens with caching on and off
(also under preemption and chunked prefill), correct prompt logprobs, num_cached_tokens, cache_salt isolation,
n > 1 children sharing prompt blocks, and the prefix-cache counters."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

BS = 16
PREFIX = (
    "You are a careful assistant. Answer each question in one short sentence. Here are some examples.\n"
    "Q: What colour is the sky on a clear day?\nA: The sky is blue on a clear day.\n"
    "Q: How many legs does a spider have?\nA: A spider has eight legs.\n"
    "Q: What is the largest planet in our solar system?\nA: Jupiter is the largest planet.\n"
    "Q: Which gas do plants take in from the air?\nA: Plants take in carbon dioxide.\n"
    "Q: What do bees make?\nA: Bees make honey.\n"
)
SUFFIXES = [
    "Q: What is the capital of Italy?\nA:",
    "Q: How many days are in a week?\nA:",
    "Q: What is frozen water called?\nA:",
    "Q: Which animal is known as the king of the jungle?\nA:",
    "Q: What is two plus two?\nA:",
    "Q: What do cows drink?\nA:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def counter(llm: LLM, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def expected_hit(cached_ids: list[int], ids: list[int]) -> int:
    """Tokens a request can take from the cache: whole blocks of the common prefix, never its last token."""
    common = 0
    while common < min(len(cached_ids), len(ids)) and cached_ids[common] == ids[common]:
        common += 1
    return min(common // BS, (len(ids) - 1) // BS) * BS


@pytest.fixture(scope="module")
def reference(smollm2):
    """Caching off: every prompt computed from scratch."""
    llm = LLM(smollm2, dtype="float32", enable_prefix_caching=False, kv_cache_memory_bytes=128 << 20)
    outs = llm.generate([PREFIX + s for s in SUFFIXES], GREEDY, use_tqdm=False)
    logprob_params = SamplingParams(max_tokens=1, prompt_logprobs=3)
    prompt_lps = llm.generate([PREFIX + SUFFIXES[0]], logprob_params, use_tqdm=False)[0].prompt_logprobs
    assert counter(llm, "vllm:prefix_cache_queries") == 0  # caching off looks nothing up
    return [o.outputs[0].token_ids for o in outs], prompt_lps


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, dtype="float32", kv_cache_memory_bytes=128 << 20)


def test_caching_on_gives_the_same_tokens_and_hits_the_shared_prefix(llm, reference):
    ref_tokens, _ = reference
    tok = llm.get_tokenizer()
    queries0 = counter(llm, "vllm:prefix_cache_queries")
    hits0 = counter(llm, "vllm:prefix_cache_hits")
    first = llm.generate(PREFIX + SUFFIXES[0], GREEDY, use_tqdm=False)[0]
    rest = llm.generate([PREFIX + s for s in SUFFIXES[1:]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in [first, *rest]] == ref_tokens
    ids0 = tok.encode(PREFIX + SUFFIXES[0])
    expected = [expected_hit(ids0, tok.encode(PREFIX + s)) for s in SUFFIXES[1:]]
    assert min(expected) >= 6 * BS  # the prefix covers many blocks
    assert [o.num_cached_tokens for o in rest] == expected
    lengths = [len(tok.encode(PREFIX + s)) for s in SUFFIXES]
    assert counter(llm, "vllm:prefix_cache_queries") - queries0 == sum(lengths)
    assert counter(llm, "vllm:prefix_cache_hits") - hits0 == first.num_cached_tokens + sum(expected)


def test_preemption_and_chunked_prefill_with_caching_give_the_same_tokens(smollm2, reference):
    ref_tokens, _ = reference
    # 18 blocks of 16 tokens for six ~160-token requests (10 blocks each, ~8 of them shared): they cannot all run
    # at once, and prompts go in 64-token chunks
    llm = LLM(smollm2, dtype="float32", num_gpu_blocks_override=18, max_num_batched_tokens=64, max_num_seqs=6)
    outs = llm.generate([PREFIX + s for s in SUFFIXES], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref_tokens
    assert counter(llm, "vllm:num_preemptions") > 0
    assert counter(llm, "vllm:prefix_cache_hits") > 0


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached(llm, reference):
    _, ref_lps = reference
    llm.generate(PREFIX + SUFFIXES[0], GREEDY, use_tqdm=False)  # the prefix is cached now
    out = llm.generate(PREFIX + SUFFIXES[0], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs[0] is None and ref_lps[0] is None
    assert len(out.prompt_logprobs) == len(ref_lps)
    for got, want in zip(out.prompt_logprobs[1:], ref_lps[1:]):
        assert got.keys() == want.keys()
        for tid in want:
            assert got[tid].logprob == pytest.approx(want[tid].logprob, abs=1e-4)
            assert got[tid].rank == want[tid].rank


def test_cache_salt_isolates_tenants(llm):
    tok = llm.get_tokenizer()
    text = "Salted shared context. " * 12 + "Question number "
    prompts = [text + str(i) for i in range(4)]
    ids = [tok.encode(p) for p in prompts]
    llm.generate({"prompt": prompts[0], "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)
    other = llm.generate({"prompt": prompts[1], "cache_salt": "tenant-b"}, GREEDY, use_tqdm=False)[0]
    unsalted = llm.generate(prompts[2], GREEDY, use_tqdm=False)[0]
    same = llm.generate({"prompt_token_ids": ids[3], "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    assert unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens == expected_hit(ids[0], ids[3]) > 0
    for bad in ["", 5]:
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate({"prompt": "hi", "cache_salt": bad}, GREEDY, use_tqdm=False)
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_n_children_share_the_prompt_blocks(llm):
    tok = llm.get_tokenizer()
    prompt = "A story about a lighthouse keeper who finds a message in a bottle. " * 4
    n = len(tok.encode(prompt))
    hits0 = counter(llm, "vllm:prefix_cache_hits")
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    # the first child computes the prompt; the other two find all its full blocks but the last token's
    assert counter(llm, "vllm:prefix_cache_hits") - hits0 == 2 * ((n - 1) // BS) * BS


def test_reset_prefix_cache_forgets_the_prefix(llm):
    prompt = PREFIX + SUFFIXES[2]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
