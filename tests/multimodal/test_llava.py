"""The tiny LLaVA against HF transformers in float32: greedy tokens with images, batched with text-only requests,
with chunked prefill cutting through an image, and with prefix caching keyed by the image."""

from __future__ import annotations

import pytest
from mm_prompts import as_prompt, make_llm
from tiny_llava import NUM_IMAGE_TOKENS, hf_generate, image

from pagedllm import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [
    ("Say: <image> what?", [image(0)]),
    ("<image>", [image(1)]),
    ("Two <image> and <image>!", [image(2), image(3, (60, 30))]),
    ("No picture here.", []),
]


@pytest.fixture(scope="module")
def llava(tiny_llava):
    return make_llm(tiny_llava[2])


@pytest.fixture(scope="module")
def expected(tiny_llava):
    hf, processor, _ = tiny_llava
    return [hf_generate(hf, processor, text, images, GREEDY.max_tokens) for text, images in PROMPTS]


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_tokens_match_hf_batched_with_text(llava, expected):
    outputs = llava.generate([as_prompt(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    # the placeholder expanded to the image's tokens: 4 per image in the prompt ids
    assert outputs[0].prompt_token_ids.count(97) == NUM_IMAGE_TOKENS


def test_each_prompt_alone_matches_hf(llava, expected):
    for (text, images), want in zip(PROMPTS, expected):
        llava.reset_prefix_cache()
        assert tokens(llava.generate(as_prompt(text, images), GREEDY, use_tqdm=False)) == [want]


@pytest.mark.parametrize("budget", [3, 5])
def test_chunked_prefill_through_an_image(tiny_llava, expected, budget):
    """A token budget of 3 or 5 cuts every image span (4 tokens) across steps."""
    llm = make_llm(tiny_llava[2], max_num_batched_tokens=budget, max_num_seqs=2, enable_prefix_caching=False)
    outputs = llm.generate([as_prompt(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    runner = llm.llm_engine.core.executor.runner
    assert runner.mm.num_encoder_runs == 4  # each image once, though its span was cut into chunks


def test_prefix_cache_hits_only_with_the_same_image(tiny_llava, expected):
    hf, processor, path = tiny_llava
    llm = make_llm(path)
    text = "A long shared prefix of text before <image>!"
    first = llm.generate(as_prompt(text, [image(7)]), GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    same = llm.generate(as_prompt(text, [image(7)]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(as_prompt(text, [image(8)]), GREEDY, use_tqdm=False)[0]
    num_before = first.prompt_token_ids.index(97)
    assert same.num_cached_tokens > num_before  # the blocks holding the image came from the cache
    assert other.num_cached_tokens == num_before // 4 * 4  # only the whole blocks before the image
    assert tokens([same]) == tokens([first]) == [hf_generate(hf, processor, text, [image(7)], GREEDY.max_tokens)]
    assert tokens([other]) == [hf_generate(hf, processor, text, [image(8)], GREEDY.max_tokens)]
    assert tokens([other]) != tokens([same])  # the image decides the tokens: a wrong hit would show
    runner = llm.llm_engine.core.executor.runner
    assert runner.mm.num_encoder_runs == 2  # image 7 encoded once (the cache hit needed no encoder)


def test_qwen2_lm_all_tokens_two_feature_layers(tmp_path_factory):
    """A Qwen2 LM (q/k/v biases), the class token kept ("full": 5 tokens an image) and two vision layers' features
    concatenated."""
    import transformers as T
    from tiny_llava import save_tiny_llava

    hf, processor, path = save_tiny_llava(
        tmp_path_factory, "llava-qwen2", T.Qwen2Config, "full", vision_feature_layer=[-3, -1]
    )
    llm = make_llm(path)
    assert type(llm.llm_engine.core.executor.runner.model.language_model).__name__ == "Qwen2ForCausalLM"
    prompts = PROMPTS[1:3]
    outputs = llm.generate([as_prompt(t, i) for t, i in prompts], GREEDY, use_tqdm=False)
    assert outputs[0].prompt_token_ids.count(97) == 5
    assert tokens(outputs) == [hf_generate(hf, processor, t, i, GREEDY.max_tokens) for t, i in prompts]


def test_async_scheduling_with_images(tiny_llava, expected):
    llm = make_llm(tiny_llava[2], async_scheduling=True, max_num_batched_tokens=5)
    outputs = llm.generate([as_prompt(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
