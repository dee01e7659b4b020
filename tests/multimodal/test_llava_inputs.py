"""Images through LLM.chat (image_url parts with data: and file:// URLs), mm_processor_kwargs, limit_mm_per_prompt,
the encoder cache budget, and bad multimodal input (a clear ValueError, the engine still serving)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from doc_scripts import http_folder
from mm_prompts import make_llm
from test_llava import GREEDY, tokens
from tiny_llava import hf_generate, image

LOOK = "Look: <image>"


def data_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(*urls: str, text: str = "Look:") -> list[dict]:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def llava(tiny_llava):
    return make_llm(tiny_llava[2], limit_mm_per_prompt={"image": 2})


def still_serves(llm, tiny_llava) -> None:
    hf, processor, _ = tiny_llava
    out = llm.generate({"prompt": LOOK, "multi_modal_data": {"image": image(4)}}, GREEDY, use_tqdm=False)
    assert tokens(out) == [hf_generate(hf, processor, LOOK, [image(4)], GREEDY.max_tokens)]
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("content_format", ["openai", "string"])
def test_chat_image_url_matches_hf(llava, tiny_llava, content_format):
    hf, processor, _ = tiny_llava
    img = image(11)
    out = llava.chat(image_message(data_url(img)), GREEDY, use_tqdm=False, chat_template_content_format=content_format)
    rendered = "user: Look:<image>\nassistant:" if content_format == "openai" else "user: Look:\n<image>\nassistant:"
    assert out[0].prompt == rendered
    assert tokens(out) == [hf_generate(hf, processor, rendered, [img], GREEDY.max_tokens)]


def test_chat_file_url_under_the_allowed_directory(tiny_llava, tmp_path):
    hf, processor, path = tiny_llava
    img = image(12)
    img.save(tmp_path / "a.png")
    llm = make_llm(path, allowed_local_media_path=str(tmp_path))
    out = llm.chat(image_message(f"file://{tmp_path}/a.png"), GREEDY, use_tqdm=False)
    rendered = "user: Look:<image>\nassistant:"
    assert tokens(out) == [hf_generate(hf, processor, rendered, [img], GREEDY.max_tokens)]
    with pytest.raises(ValueError, match=r"outside the allowed local media directory"):
        llm.chat(image_message(f"file://{tmp_path}/../a.png"), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"file:// URLs need an allowed local media directory"):
        make_llm(path).chat(image_message(f"file://{tmp_path}/a.png"), GREEDY, use_tqdm=False)


@pytest.fixture
def image_host(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path; yields its base URL."""
    with http_folder(tmp_path) as url:
        yield url


def test_chat_http_url_fetched_within_limits(llava, tiny_llava, image_host, tmp_path, monkeypatch):
    hf, processor, _ = tiny_llava
    img = image(14)
    img.save(tmp_path / "a.png")
    out = llava.chat(image_message(f"{image_host}/a.png"), GREEDY, use_tqdm=False)
    assert tokens(out) == [hf_generate(hf, processor, "user: Look:<image>\nassistant:", [img], GREEDY.max_tokens)]
    with pytest.raises(ValueError, match=r"content\[1\]\.image_url: the image could not be fetched .*404"):
        llava.chat(image_message(f"{image_host}/missing.png"), GREEDY, use_tqdm=False)
    monkeypatch.setattr("pagedllm.multimodal.media.MAX_IMAGE_BYTES", 100)
    with pytest.raises(ValueError, match=r"is larger than the allowed 100 bytes"):
        llava.chat(image_message(f"{image_host}/a.png"), GREEDY, use_tqdm=False)
    still_serves(llava, tiny_llava)


def test_mm_processor_kwargs_reach_the_processor(llava, tiny_llava):
    hf, processor, _ = tiny_llava
    img = image(13)
    prompt = {"prompt": LOOK, "multi_modal_data": {"image": img}, "mm_processor_kwargs": {"do_normalize": False}}
    out = llava.generate(prompt, GREEDY, use_tqdm=False)
    inputs = processor(text=[LOOK], images=[img], return_tensors="pt", do_normalize=False)
    import torch

    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0)
    assert tokens(out) == [want[0, inputs["input_ids"].shape[1] :].tolist()]
    assert tokens(out) != [hf_generate(hf, processor, LOOK, [img], GREEDY.max_tokens)]  # the option mattered


def test_no_encoder_cache_still_correct(tiny_llava, monkeypatch):
    """With a zero budget nothing is cached: each chunk through an image encodes it again, with the same result."""
    hf, processor, path = tiny_llava
    monkeypatch.setenv("VLLM_MM_INPUT_CACHE_GIB", "0")
    llm = make_llm(path, max_num_batched_tokens=3, enable_prefix_caching=False)
    out = llm.generate({"prompt": LOOK, "multi_modal_data": {"image": image(5)}}, GREEDY, use_tqdm=False)
    assert tokens(out) == [hf_generate(hf, processor, LOOK, [image(5)], GREEDY.max_tokens)]
    assert llm.llm_engine.core.executor.runner.mm.num_encoder_runs == 2  # the 4 image tokens came in 2 chunks


BAD_PROMPTS = [
    (
        {"prompt": "<image><image><image>", "multi_modal_data": {"image": [image(0)] * 3}},
        r"prompts\[1\]\.multi_modal_"
        r"data\['image'\] has 3 items, more than limit_mm_per_prompt\['image'\]=2: allowed range \[0, 2\]",
    ),
    (
        {"prompt": "no placeholder", "multi_modal_data": {"image": image(0)}},
        r"prompts\[1\]: the prompt has 0 image "
        r"placeholders '<image>' for 1 images",
    ),
    ({"prompt": LOOK, "multi_modal_data": {"video": [image(0)]}}, r"modality 'video' is not one the model takes"),
    ({"prompt": LOOK, "multi_modal_data": {"image": "cat.png"}}, r"\['image'\]\[0\] has type str; expected a PIL"),
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": image(0)}}, r"multi_modal_data needs a text 'prompt'"),
    (
        {"prompt": LOOK, "multi_modal_data": {"image": np.zeros((9000, 8000, 3), dtype=np.uint8)}},
        r"\['image'\]\[0\] is 8000x9000 pixels, more than the allowed 67108864",
    ),
]


@pytest.mark.parametrize("prompt, match", BAD_PROMPTS)
def test_bad_multimodal_prompts(llava, tiny_llava, prompt, match):
    with pytest.raises(ValueError, match=match):
        llava.generate([{"prompt": LOOK, "multi_modal_data": {"image": image(1)}}, prompt], GREEDY, use_tqdm=False)
    still_serves(llava, tiny_llava)


BAD_CHATS = [
    (image_message("data:image/png;base64," + base64.b64encode(b"not a png").decode()), r"cannot be decoded"),
    (image_message("data:image/png;base64,@@@"), r"base64 is invalid"),
    (image_message("ftp://127.0.0.1/a.png"), r"URL scheme 'ftp' is not supported"),
    (image_message(*[data_url(image(0))] * 3), r"has 3 items, more than limit_mm_per_prompt\['image'\]=2"),
]


@pytest.mark.parametrize("messages, match", BAD_CHATS)
def test_bad_chat_images(llava, tiny_llava, messages, match):
    with pytest.raises(ValueError, match=match):
        llava.chat(messages, GREEDY, use_tqdm=False)
    still_serves(llava, tiny_llava)


def test_truncated_image(llava, tiny_llava):
    buf = io.BytesIO()
    image(0).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()[: len(buf.getvalue()) // 2]).decode()
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]\.image_url: the image cannot be decoded"):
        llava.chat(image_message(url), GREEDY, use_tqdm=False)
    still_serves(llava, tiny_llava)


def test_image_limit_zero_runs_text_only_without_the_vision_tower(tiny_llava):
    hf, processor, path = tiny_llava
    llm = make_llm(path, limit_mm_per_prompt={"image": 0})
    model = llm.llm_engine.core.executor.runner.model
    assert model.vision_tower is None and not any("vision" in n for n, _ in model.named_parameters())
    assert llm.llm_engine.core.executor.runner.mm is None
    out = llm.generate("Only text.", GREEDY, use_tqdm=False)
    assert tokens(out) == [hf_generate(hf, processor, "Only text.", [], GREEDY.max_tokens)]
    with pytest.raises(ValueError, match=r"more than limit_mm_per_prompt\['image'\]=0"):
        llm.generate({"prompt": LOOK, "multi_modal_data": {"image": image(0)}}, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("prompt", ["A typed <image> with no image", [65, 97, 66]])
def test_image_tokens_without_an_image(llava, tiny_llava, prompt):
    with pytest.raises(ValueError, match=r"1 image placeholder tokens \(id 97\) but 0 from its images"):
        llava.generate(prompt, GREEDY, use_tqdm=False)
    still_serves(llava, tiny_llava)
