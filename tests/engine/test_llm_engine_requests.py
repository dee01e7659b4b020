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
