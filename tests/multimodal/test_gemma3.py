"""The tiny Gemma3ForConditionalGeneration against HF transformers in float32 (HF's generate with the processor's
token_type_ids: bidirectional attention among one image's tokens in prefill): greedy tokens batched with text-only
requests, the first token's logprobs (which the image mask moves), chunked prefill that never cuts an image, prefix
caching keyed by the image, limit_mm_per_prompt and the options it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mm_prompts import as_prompt, make_llm
from tiny_gemma3 import IMAGE_TOKEN_ID, NUM_IMAGE_TOKENS, hf_generate, image

from pagedllm import SamplingParams
from pagedllm.engine.scheduler import keep_items_whole
from pagedllm.multimodal.inputs import MultiModalFeature

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [
    ("Say: <start_of_image> what?", [image(0)]),
    ("<start_of_image>", [image(1)]),
    ("Two <start_of_image> and <start_of_image>!", [image(2), image(3, (60, 30))]),
    ("No picture here.", []),
]


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3):
    return make_llm(tiny_gemma3[2], limit_mm_per_prompt={"image": 2})


@pytest.fixture(scope="module")
def expected(tiny_gemma3):
    hf, processor, _ = tiny_gemma3
    return [hf_generate(hf, processor, text, images, GREEDY.max_tokens) for text, images in PROMPTS]


def test_greedy_tokens_match_hf_batched_with_text(gemma3, expected):
    outputs = gemma3.generate([as_prompt(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    ids = outputs[0].prompt_token_ids  # "\n\n<start_of_image>" + 4 placeholders + "<end_of_image>\n\n"
    start = ids.index(97)
    assert ids[start - 2 : start + NUM_IMAGE_TOKENS + 4] == [95, 95, 97, *[IMAGE_TOKEN_ID] * 4, 98, 95, 95]


def hf_first_logprobs(hf, processor, text: str, images: list, bidirectional: bool) -> torch.Tensor:
    """HF's log-softmax [vocab] after the prompt, with the image mask (token_type_ids) or causal."""
    inputs = processor(text=[text], images=images, return_tensors="pt")
    if not bidirectional:
        inputs.pop("token_type_ids")
    with torch.no_grad():
        return hf(**inputs).logits[0, -1].log_softmax(-1)


@pytest.mark.parametrize("index", [1, 2])
def test_first_logprobs_follow_the_image_mask(gemma3, tiny_gemma3, index):
    """The logprobs after the prompt are HF's with the bidirectional image mask, not the causal ones."""
    hf, processor, _ = tiny_gemma3
    text, images = PROMPTS[index]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    out = gemma3.generate(as_prompt(text, images), params, use_tqdm=False)[0].outputs[0]
    ours = {t: lp.logprob for t, lp in out.logprobs[0].items()}
    ids = list(ours)
    masked = hf_first_logprobs(hf, processor, text, images, True)[ids].numpy()
    causal = hf_first_logprobs(hf, processor, text, images, False)[ids].numpy()
    np.testing.assert_allclose(list(ours.values()), masked, atol=1e-4, rtol=0)
    assert np.abs(causal - masked).max() > 1e-2  # the mask matters here: a causal prefill would fail


@pytest.mark.parametrize("budget", [4, 6, 9])
def test_chunked_prefill_never_cuts_an_image(tiny_gemma3, expected, budget):
    llm = make_llm(tiny_gemma3[2], max_num_batched_tokens=budget, max_num_seqs=2, enable_prefix_caching=False)
    scheduler = llm.llm_engine.core.scheduler
    chunks = []  # (request's image spans, first position, token count) of every scheduled chunk
    schedule = scheduler.schedule

    def recording_schedule():
        so = schedule()
        for req_id, n in so.num_scheduled_tokens.items():
            req = scheduler.requests[req_id]
            chunks.append(([(f.offset, f.end) for f in req.mm_features], req.num_computed_tokens - n, n))
        return so

    scheduler.schedule = recording_schedule
    outputs = llm.generate([as_prompt(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    assert llm.llm_engine.core.executor.runner.mm.num_encoder_runs == 4
    assert any(0 < n < budget for _, _, n in chunks)  # some chunk stopped early, before an image
    for spans, start, n in chunks:
        assert not any(lo < start + n < hi for lo, hi in spans), (spans, start, n)


def test_keep_items_whole():
    class Req:
        mm_features = [MultiModalFeature("image", "a", 10, 4, {}, bidirectional=True)]

    assert keep_items_whole(Req, 0, 8) == 8  # ends before the image
    assert keep_items_whole(Req, 0, 12) == 10  # would end inside: stops before it
    assert keep_items_whole(Req, 0, 14) == 14  # holds all of it
    assert keep_items_whole(Req, 10, 3) == 0  # starts at it, too little budget: waits
    assert keep_items_whole(Req, 12, 1) == 0  # starts inside it (a prefix-cache hit): the rest or nothing
    assert keep_items_whole(Req, 12, 2) == 2
    Req.mm_features[0].bidirectional = False  # LLaVA's, Qwen2-VL's: any cut is fine
    assert keep_items_whole(Req, 0, 12) == 12


def test_image_longer_than_the_token_budget_is_refused(tiny_gemma3):
    llm = make_llm(tiny_gemma3[2], max_num_batched_tokens=3)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=3 is less than an image's 4 tokens"):
        llm.generate(as_prompt(*PROMPTS[0]), GREEDY, use_tqdm=False)
    assert tokens(llm.generate(as_prompt(*PROMPTS[3]), GREEDY, use_tqdm=False))[0]  # still serves


def test_prefix_cache_hits_only_with_the_same_image(tiny_gemma3):
    hf, processor, path = tiny_gemma3
    llm = make_llm(path)
    text = "A long shared prefix of text before <start_of_image>!"
    first = llm.generate(as_prompt(text, [image(7)]), GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    same = llm.generate(as_prompt(text, [image(7)]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(as_prompt(text, [image(8)]), GREEDY, use_tqdm=False)[0]
    num_before = first.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert same.num_cached_tokens > num_before  # the blocks holding the image came from the cache
    assert other.num_cached_tokens == num_before // 4 * 4  # only the whole blocks before the image
    assert tokens([same]) == tokens([first]) == [hf_generate(hf, processor, text, [image(7)], GREEDY.max_tokens)]
    assert tokens([other]) == [hf_generate(hf, processor, text, [image(8)], GREEDY.max_tokens)]
    assert tokens([other]) != tokens([same])  # the image decides the tokens: a wrong hit would show
    assert llm.llm_engine.core.executor.runner.mm.num_encoder_runs == 2


def test_prefix_cache_hit_ending_inside_an_image(tiny_gemma3):
    """Blocks of 16: two prompts share 10 characters, the image (at positions 13-16) and what follows it; the hit
    (one block) ends inside the image, so the second prompt's prefill starts at its last image token."""
    hf, processor, path = tiny_gemma3
    llm = make_llm(path, block_size=16)
    first, second = "0123456789<start_of_image> then this?", "0123456789<start_of_image> or that!"
    a = llm.generate(as_prompt(first, [image(4)]), GREEDY, use_tqdm=False)[0]
    b = llm.generate(as_prompt(second, [image(4)]), GREEDY, use_tqdm=False)[0]
    assert a.prompt_token_ids.index(IMAGE_TOKEN_ID) == 13 and b.num_cached_tokens == 16
    assert tokens([a]) == [hf_generate(hf, processor, first, [image(4)], GREEDY.max_tokens)]
    assert tokens([b]) == [hf_generate(hf, processor, second, [image(4)], GREEDY.max_tokens)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_read_kv_reads_the_slots_written(backend):
    """read_kv in each backend's cache layout gives back the K/V that forward wrote to those slots."""
    import importlib

    module = importlib.import_module(f"pagedllm.attention.{backend}_backend")
    torch.manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 8
    slot_major = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)  # the Triton layout
    cache = slot_major if backend == "triton" else module.from_slot_major(slot_major)
    slots = torch.tensor([7, 0, 19, 4, 4])
    k, v = module.read_kv(cache, slots, head_dim)
    flat = slot_major.view(2, -1, num_kv_heads, head_dim)
    torch.testing.assert_close(k, flat[0, slots], rtol=0, atol=0)
    torch.testing.assert_close(v, flat[1, slots], rtol=0, atol=0)


def test_limit_mm_per_prompt(gemma3):
    three = as_prompt("<start_of_image>" * 3, [image(1)] * 3)
    with pytest.raises(ValueError, match=r"has 3 items, more than limit_mm_per_prompt\['image'\]=2"):
        gemma3.generate(three, GREEDY, use_tqdm=False)


def test_image_limit_zero_runs_text_only_without_the_vision_tower(tiny_gemma3, expected):
    llm = make_llm(tiny_gemma3[2], limit_mm_per_prompt={"image": 0})
    model = llm.llm_engine.core.executor.runner.model
    assert model.vision_tower is None and not any("vision" in n for n, _ in model.named_parameters())
    assert tokens(llm.generate(as_prompt(*PROMPTS[3]), GREEDY, use_tqdm=False)) == [expected[3]]
    with pytest.raises(ValueError, match=r"more than limit_mm_per_prompt\['image'\]=0"):
        llm.generate(as_prompt(*PROMPTS[0]), GREEDY, use_tqdm=False)


def test_pan_and_scan_is_refused(gemma3):
    prompt = dict(as_prompt(*PROMPTS[0]), mm_processor_kwargs={"do_pan_and_scan": True})
    with pytest.raises(ValueError, match=r"do_pan_and_scan=True is not supported for Gemma 3"):
        gemma3.generate(prompt, GREEDY, use_tqdm=False)


def test_image_embeddings_are_refused(gemma3, tiny_gemma3):
    """Gemma 3 wraps each image in its own tokens: precomputed embeddings (enable_mm_embeds) are not taken."""
    import torch

    from pagedllm.multimodal.config import MultiModalConfig
    from pagedllm.multimodal.processor import make_processor

    model = gemma3.llm_engine.config.model
    hf_config, config = model.hf_config.vision_language_config, MultiModalConfig(enable_embeds=True)
    processor = make_processor(model.architecture, model.model_path, hf_config, config, False)
    with pytest.raises(ValueError, match=r"\['image'\]: image embeddings are not supported for this model"):
        processor.process("<start_of_image>", {"image": torch.zeros(1, 4, 64)})


def test_chat_image_url_matches_hf(gemma3, tiny_gemma3):
    import base64
    import io

    hf, processor, _ = tiny_gemma3
    buf = io.BytesIO()
    image(5).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parts = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}}]
    out = gemma3.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    text = "user: Look:<start_of_image>\nassistant:"
    assert tokens([out]) == [hf_generate(hf, processor, text, [image(5)], GREEDY.max_tokens)]


@pytest.mark.slow
def test_tensor_parallel_with_images(tiny_gemma3, expected):
    """TP=2 over two CPU processes: the language model split, each rank running the whole vision tower."""
    llm = make_llm(tiny_gemma3[2], tensor_parallel_size=2, max_num_batched_tokens=6)
    outputs = llm.generate([as_prompt(t, i) for t, i in PROMPTS], GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected


def test_profile_encoder_input(gemma3):
    """The memory profile's dummy image is the tower's size and gives one image's tokens."""
    model = gemma3.llm_engine.core.executor.runner.model
    data = model.dummy_multimodal_data()
    assert tuple(data["pixel_values"].shape) == (1, 3, 56, 56)
    with torch.no_grad():
        assert tuple(model.embed_multimodal("image", data).shape) == (NUM_IMAGE_TOKENS, 64)
