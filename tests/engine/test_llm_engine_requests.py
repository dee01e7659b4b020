"""LLMEngine's request handling on a tiny random Llama: abort_request takes one id or many, stop_token_ids outside
the vocabulary are accepted (they never match, as in vLLM), bad_words become token sequences in linear time, and
multimodal data given to a text-only model is an error (not dropped)."""

from __future__ import annotations

import pytest
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import _bad_words_token_ids

LONG = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    _, path = save_tiny_decoder(
        "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )
    return LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20)


def run_until_done(engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    return done


@pytest.mark.parametrize("abort", [lambda ids: ids[0], lambda ids: [ids[0]], lambda ids: (i for i in ids[:1])])
def test_abort_request_takes_one_id_or_an_iterable_of_ids(llm, abort):
    engine = llm.llm_engine
    ids = ["12", "1", "2"]  # "12" as a str must not be read as the ids "1" and "2"
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [5 + i, 6, 7], LONG)
    engine.step()
    engine.abort_request(abort(ids))
    done = run_until_done(engine)
    assert sorted(done) == ["1", "2"] and all(len(t) == 6 for t in done.values())
    assert engine.core.scheduler.kv.pool.usage() == 0


@pytest.mark.parametrize("min_tokens", [0, 2])
def test_stop_token_ids_outside_the_vocabulary_never_match(llm, min_tokens):
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5]}
    expected = llm.generate(prompt, LONG, use_tqdm=False)[0].outputs[0].token_ids
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, min_tokens=min_tokens, stop_token_ids=[320, 10**7]
    )  # the vocabulary is [0, 320)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected and out.finish_reason == "length" and out.stop_reason is None


class CountingIds(list):
    """Token ids that count how often they are compared with another list."""

    comparisons = 0

    def __eq__(self, other):
        CountingIds.comparisons += 1
        return list.__eq__(self, other)

    __hash__ = None


class CharTokenizer:
    """One token per character (its code point); both the single and the batch calls of a HF tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return CountingIds(ord(c) for c in text)

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict:
        return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}


def plain_bad_words(words: list[str]) -> list[list[int]]:
    """Each word alone and after a space, as code points, first occurrences in order."""
    seqs = []
    for w in words:
        for text in (w, " " + w.lstrip()):
            if [ord(c) for c in text] not in seqs:
                seqs.append([ord(c) for c in text])
    return seqs


def test_bad_words_token_ids_are_the_plain_rules_and_linear_in_the_words():
    words = ["ab", " ab", "ab", "c", "  d e", "c"] + [f"w{i}" for i in range(3000)]
    CountingIds.comparisons = 0
    got = _bad_words_token_ids(CharTokenizer(), words)
    assert got == plain_bad_words(words)
    assert CountingIds.comparisons <= 2 * len(words)  # no search of each sequence through a list: quadratic


@pytest.mark.parametrize("key", ["multi_modal_data", "mm_processor_kwargs"])
def test_multimodal_data_for_a_text_only_model_is_an_error(llm, key):
    prompt = {"prompt_token_ids": [3, 1, 4], key: {"image": [[0, 0, 0]]}}
    with pytest.raises(ValueError, match=rf"prompts\[0\]\.{key}: LlamaForCausalLM is a text-only model"):
        llm.generate(prompt, LONG, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_step_returns_every_request_that_got_tokens(llm):
    """vLLM's step(): each request that got a token, finished=False until its last step; cumulative outputs."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([{"prompt_token_ids": [9, 8, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("s", [9, 8, 7], params)
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o.request_id, o.finished, list(o.outputs[0].token_ids)) for o in engine.step()]
    assert [(f, t) for _, f, t in seen] == [(i == 3, expected[: i + 1]) for i in range(4)]


def test_add_request_keywords_of_vllm(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"priority=1: only first-come-first-served"):
        engine.add_request("p", [1, 2], LONG, priority=1)
    with pytest.raises(ValueError, match=r"prompt\.prompt_embeds: .* enable_prompt_embeds=True"):
        engine.add_request("p", {"prompt_embeds": [0.0]}, LONG)
    with pytest.raises(ValueError, match=r"prompt\.mm_processor_kwargs: LlamaForCausalLM is a text-only model"):
        engine.add_request("p", {"prompt_token_ids": [1, 2], "mm_processor_kwargs": {}}, LONG)
    with pytest.raises(ValueError, match=r"prompt\.cache_salt=''"):
        engine.add_request("p", {"prompt_token_ids": [1, 2], "cache_salt": ""}, LONG)
    assert not engine.has_unfinished_requests()
    import time

    arrival = time.time() - 100.0
    engine.add_request("t", [1, 2, 3], LONG, arrival_time=arrival)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].metrics.arrival_time == pytest.approx(arrival, abs=0.05)
    assert outs[-1].metrics.time_in_queue >= 100.0


def test_a_prompt_dicts_cache_salt_is_honoured(llm):
    """The same prompt under another salt finds no cached prefix (the salt reaches the request)."""
    engine = llm.llm_engine
    prompt = list(range(1, 40))
    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")):
        engine.add_request(rid, {"prompt_token_ids": prompt, "cache_salt": salt}, LONG)
        while engine.has_unfinished_requests():
            done = [o for o in engine.step() if o.finished]
        assert done[0].request_id == rid
        cached = done[0].num_cached_tokens
        assert (cached > 0) == (rid == "c"), (rid, cached)
