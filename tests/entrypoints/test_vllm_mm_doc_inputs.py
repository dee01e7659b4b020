"""vLLM's multimodal-inputs page, the options beyond plain images, run with only the names changed
(tests/doc_scripts.py; the tiny models and media of tests/conftest.py): the RGBA background colour of chat
images (media_io_kwargs), stable item ids for caching (multi_modal_uuids) and precomputed image embeddings
(enable_mm_embeds: LLaVA's tensor, Qwen2-VL's embeddings with their grids, chat image_embeds parts). What a script
prints must be HF transformers' greedy text for the same prompt and images; what the page shows and pagedllm does
not do (media skipped by id, base64 embeddings) is a ValueError naming it."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_llava
import tiny_qwen2_vl
import torch
from doc_scripts import run_script
from mm_doc_helpers import (
    LLAVA_HUB,
    QWEN,
    QWEN_HUB,
    hf_texts,
    load,
    printed,
)

pytestmark = pytest.mark.usefixtures("mm_doc_env")


# the page's custom RGBA background: transparent pixels of an image_url over white (the default), black or blue
RGBA_BACKGROUND = """
from vllm import LLM

image_url = "https://upload.wikimedia.org/logo.png"
messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}}]}]
llm = LLM(model="llava-hf/llava-1.5-7b-hf")
print(llm.chat(messages)[0].outputs[0].text)
llm = LLM(model="llava-hf/llava-1.5-7b-hf", media_io_kwargs={"image": {"rgba_background_color": [0, 0, 0]}})
print(llm.chat(messages)[0].outputs[0].text)
llm = LLM(model="llava-hf/llava-1.5-7b-hf", media_io_kwargs={"image": {"rgba_background_color": [0, 0, 255]}})
print(llm.chat(messages)[0].outputs[0].text)
"""


def test_rgba_background_color(llava_docs, doc_media):
    from PIL import Image

    hf, processor, path = llava_docs
    folder, base = doc_media
    pixels = np.asarray(load(folder, "2.png"))  # [56, 50, 3]
    rgba = np.concatenate([pixels, np.zeros((*pixels.shape[:2], 1), np.uint8)], axis=2)
    rgba[10:40, 10:40, 3] = 255  # an opaque square on a transparent field
    Image.fromarray(rgba, "RGBA").save(folder / "logo.png")
    names = dict.fromkeys(LLAVA_HUB, path) | {"https://upload.wikimedia.org/logo.png": f"{base}/logo.png"}
    out = run_script(RGBA_BACKGROUND, names)
    composites = []
    for color in ((255, 255, 255), (0, 0, 0), (0, 0, 255)):
        over = Image.new("RGBA", (pixels.shape[1], pixels.shape[0]), (*color, 255))
        composites.append(Image.alpha_composite(over, Image.fromarray(rgba, "RGBA")).convert("RGB"))
    requests = [("user: <image>\nassistant:", [c]) for c in composites]
    want = hf_texts(tiny_llava.hf_generate, hf, processor, requests)
    assert out == printed(want) and len(set(want)) == 3  # each background shows
    from pagedllm import LLM

    for bad, match in [
        ({"video": {"num_frames": 8}}, r"media_io_kwargs=.* is not supported: the only option is"),
        ({"image": {"rgba_background_color": [0, 0, 256]}}, r"rgba_background_color'\]=\[0, 0, 256\] must be 3"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(path, media_io_kwargs=bad)


# the page's stable ids for caching (its Qwen2.5-VL call, whose prompt is in LLaVA's format: run on the tiny LLaVA),
# then its call that skips an item expected in the cache
UUIDS = """
from PIL import Image
from vllm import LLM

llm = LLM(model="Qwen/Qwen2.5-VL-3B-Instruct")
prompt = "USER: <image><image>\\nDescribe the differences.\\nASSISTANT:"
img_a = Image.open("/path/to/a.jpg")
img_b = Image.open("/path/to/b.jpg")
outputs = llm.generate({
    "prompt": prompt,
    "multi_modal_data": {"image": [img_a, img_b]},
    "multi_modal_uuids": {"image": ["sku-1234-a", None]},
})
for o in outputs:
    print(o.outputs[0].text)
if SKIP:
    outputs = llm.generate({
        "prompt": prompt,
        "multi_modal_data": {"image": [None, img_b]},
        "multi_modal_uuids": {"image": ["sku-1234-a", None]},
    })
"""


def test_multi_modal_uuids(llava_docs, doc_media):
    """A uuid is the item's identity: the encoder cache and the prefix cache reuse the work of the item sent with
    it before, whatever pixels come with it later; None keeps the content hash."""
    hf, processor, path = llava_docs
    folder, _ = doc_media
    names = {"Qwen/Qwen2.5-VL-3B-Instruct": path, "/path/to/a.jpg": str(folder / "0.png")}
    names |= {"/path/to/b.jpg": str(folder / "1.png")}
    namespace = {}
    out = run_script(UUIDS.replace("SKIP", "False"), names, namespace=namespace)
    prompt = "USER: <image><image>\nDescribe the differences.\nASSISTANT:"
    img_a, img_b, img_c = (load(folder, f"{i}.png") for i in range(3))
    assert out == printed(hf_texts(tiny_llava.hf_generate, hf, processor, [(prompt, [img_a, img_b])]))
    llm = namespace["llm"]
    runner = llm.llm_engine.core.executor.runner.mm
    assert runner.num_encoder_runs == 2
    # other pixels under the same uuid: the cached encoder output (img_a's) stands for them, as the id promises
    again = llm.generate(
        {
            "prompt": prompt,
            "multi_modal_data": {"image": [img_c, img_b]},
            "multi_modal_uuids": {"image": ["sku-1234-a", None]},
        }
    )[0]
    assert runner.num_encoder_runs == 2 and again.num_cached_tokens > 0
    assert printed([again.outputs[0].text]) == out
    # without the uuid the content decides: img_c is encoded and the text is img_c's
    plain = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [img_c, img_b]}})[0]
    assert runner.num_encoder_runs == 3
    assert plain.outputs[0].text == hf_texts(tiny_llava.hf_generate, hf, processor, [(prompt, [img_c, img_b])])[0]
    bad = [
        ({"image": ["a"]}, r"multi_modal_uuids\['image'\]: 1 ids for 2 items"),
        ({"image": ["a", 3]}, r"give one non-empty str \(or None"),
        (
            {"video": ["a", "b"]},
            r"multi_modal_uuids must be a dict with the modalities of multi_modal_data \['image'\]",
        ),
    ]
    for uuids, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt": prompt, "multi_modal_data": {"image": [img_a, img_b]}, "multi_modal_uuids": uuids})
    with pytest.raises(ValueError, match=r"\['image'\]: an item is None; send every item"):
        run_script(UUIDS.replace("SKIP", "True"), names)


# the page's embedding inputs: LLaVA's precomputed image features as a tensor [1, feature_size, hidden], Qwen2-VL's
# with their grids (two images); here the features are HF's own for real images
EMBEDDINGS = """
import torch
from vllm import LLM

if MODEL == "llava":
    llm = LLM(model="llava-hf/llava-1.5-7b-hf", enable_mm_embeds=True)
    prompt = "USER: <image>\\nWhat is the content of this image?\\nASSISTANT:"
    image_embeds = torch.load("image_embeds.pt")
    mm_data = {"image": image_embeds}
else:
    prompt = PROMPT
    image_embeds = torch.load("image_embeds.pt")
    llm = LLM("Qwen/Qwen2-VL-2B-Instruct", limit_mm_per_prompt={"image": 4}, enable_mm_embeds=True)
    mm_data = {"image": {"image_embeds": image_embeds, "image_grid_thw": torch.load("image_grid_thw.pt")}}
outputs = llm.generate({"prompt": prompt, "multi_modal_data": mm_data})
for o in outputs:
    print(o.outputs[0].text)
"""


def embeddings_script(model: str, prompt: str = "") -> str:
    return EMBEDDINGS.replace("MODEL", repr(model)).replace("PROMPT", repr(prompt))


def test_image_embeddings_llava(llava_docs, doc_media, tmp_path):
    hf, processor, path = llava_docs
    folder, _ = doc_media
    prompt = "USER: <image>\nWhat is the content of this image?\nASSISTANT:"
    img = load(folder, "1.png")
    with torch.no_grad():
        pixels = processor(text=[prompt], images=[img], return_tensors="pt")["pixel_values"]
        features = hf.model.get_image_features(pixel_values=pixels).pooler_output[0]  # [4, hidden]
    torch.save(features[None], tmp_path / "embeds.pt")
    names = dict.fromkeys(LLAVA_HUB, path) | {"image_embeds.pt": str(tmp_path / "embeds.pt")}
    namespace = {}
    out = run_script(embeddings_script("llava"), names, namespace=namespace)
    assert out == printed(hf_texts(tiny_llava.hf_generate, hf, processor, [(prompt, [img])]))
    llm = namespace["llm"]
    assert llm.llm_engine.core.executor.runner.mm.num_encoder_runs == 0  # the embeddings stood for the encoder
    bad = [
        (features[:, :32], r"\[0\]: image embeddings must be float tensors of shape .*got \(4, 32\)"),
        ([features, img], r"give either images or image embeddings, not both"),
        (features.long(), r"must be float tensors"),
    ]
    for data, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt": prompt, "multi_modal_data": {"image": data}})
    with pytest.raises(ValueError, match=r"\['image'\]: image embeddings \(a tensor\) need .*enable_mm_embeds=True"):
        namespace["LLM"](path).generate({"prompt": prompt, "multi_modal_data": {"image": features}})
    assert llm.generate({"prompt": prompt, "multi_modal_data": {"image": img}})[0].outputs[0].text == out.strip()
    # LLM.chat with an image_embeds part (the page's chat example, the embeddings alone)
    parts = [{"type": "image_embeds", "image_embeds": features[None]}, {"type": "text", "text": "What's in it?"}]
    chat = llm.chat([{"role": "user", "content": parts}])
    rendered = "user: <image>What's in it?\nassistant:"
    assert printed([chat[0].outputs[0].text]) == printed(
        hf_texts(tiny_llava.hf_generate, hf, processor, [(rendered, [img])])
    )


@QWEN
def test_image_embeddings_qwen2_vl(qwen_docs, doc_media, tmp_path):
    hf, processor, path = qwen_docs
    folder, _ = doc_media
    image = tiny_qwen2_vl.IMAGE
    prompt = f"<|im_start|>user\n{image}{image}What is the content of each image?<|im_end|>\n<|im_start|>assistant\n"
    images = [load(folder, "q2.png"), load(folder, "1.png")]
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    grids = inputs["image_grid_thw"]  # [[1, 6, 8], [1, 4, 4]]: 12 and 4 tokens
    with torch.no_grad():
        per_image = hf.model.get_image_features(inputs["pixel_values"], grids).pooler_output
    torch.save(torch.cat(per_image), tmp_path / "embeds.pt")  # [16, hidden]
    torch.save(grids, tmp_path / "grids.pt")
    names = dict.fromkeys(QWEN_HUB, path) | {"image_embeds.pt": str(tmp_path / "embeds.pt")}
    names |= {"image_grid_thw.pt": str(tmp_path / "grids.pt")}
    namespace = {}
    out = run_script(embeddings_script("qwen2_vl", prompt), names, namespace=namespace)
    want = hf_texts(tiny_qwen2_vl.hf_generate, hf, processor, [(prompt, images)])
    assert out == printed(want)
    # M-RoPE placed the embeddings by their grids: the same tokens as the images themselves
    llm = namespace["llm"]
    direct = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}})[0]
    assert direct.outputs[0].text == want[0] and namespace["outputs"][0].prompt_token_ids == direct.prompt_token_ids
    embeds = torch.cat(per_image)
    assert grids.tolist() == [[1, 6, 8], [1, 4, 4]] and embeds.shape == (16, 64)
    bad = [
        ({"image_embeds": embeds[:15], "image_grid_thw": grids}, r"has shape \(15, 64\); its grids need \[16, 64\]"),
        ({"image_embeds": embeds, "image_grid_thw": grids[:, :2]}, r"must be integers >= 1 of shape \[num_images, 3\]"),
        ({"image_embeds": embeds, "image_grid_thw": "1x6x8"}, r"must be integers >= 1 of shape"),
        ({"image_embeds": embeds}, r"expected exactly the keys 'image_embeds' \(a tensor\) and 'image_grid_thw'"),
        (embeds, r"Qwen2-VL's image embeddings come as \{'image_embeds'"),
    ]
    for data, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt": prompt, "multi_modal_data": {"image": data}})
    # LLM.chat with an image_embeds part carrying the dict; base64 strings (the server's form) are refused
    part = {"type": "image_embeds", "image_embeds": {"image_embeds": per_image[0], "image_grid_thw": grids[:1]}}
    chat = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "Look"}]}])
    rendered = f"user: {image}Look\nassistant:"
    assert chat[0].outputs[0].text == hf_texts(tiny_qwen2_vl.hf_generate, hf, processor, [(rendered, images[:1])])[0]
    part = {"type": "image_embeds", "image_embeds": {"image_embeds": "AAAA", "image_grid_thw": "AAAA"}}
    with pytest.raises(ValueError, match=r"content\[0\]: base64-encoded image embeddings are not supported"):
        llm.chat([{"role": "user", "content": [part]}])
