"""vLLM's multimodal page, online: its `vllm serve` line for a vision model and its openai-client calls with
image_url parts (one image, then two, each with the optional uuid), run with only the names changed (`vllm` ->
`pagedllm`, the hub model -> the tiny LLaVA with greedy generation defaults, the https image URLs -> a local HTTP
server). The replies must be HF transformers' greedy text for the rendered prompt and the same images."""

from __future__ import annotations

import shlex

from conftest import RemoteServer
from doc_scripts import greedy_copy, http_folder, run_script
from tiny_llava import hf_generate, image

MAX_TOKENS = 6
LAUNCH = (
    "vllm serve microsoft/Phi-3.5-vision-instruct --runner generate --trust-remote-code --max-model-len 4096 "
    "--limit-mm-per-prompt '{\"image\":2}'"
)
CLIENT = """
from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = "http://localhost:8000/v1"
client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)

image_url = "https://vllm-public-assets.s3.us-west-2.amazonaws.com/vision_model_images/boardwalk.jpg"
chat_response = client.chat.completions.create(
    model="microsoft/Phi-3.5-vision-instruct",
    messages=[
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What's in this image?"},
                {"type": "image_url", "image_url": {"url": image_url}, "uuid": image_url},
            ],
        }
    ],
)
print("Chat completion output:", chat_response.choices[0].message.content)

image_url_duck = "https://vllm-public-assets.s3.us-west-2.amazonaws.com/multimodal_asset/duck.jpg"
image_url_lion = "https://vllm-public-assets.s3.us-west-2.amazonaws.com/multimodal_asset/lion.jpg"
chat_response = client.chat.completions.create(
    model="microsoft/Phi-3.5-vision-instruct",
    messages=[
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What are the animals in these images?"},
                {"type": "image_url", "image_url": {"url": image_url_duck}, "uuid": image_url_duck},
                {"type": "image_url", "image_url": {"url": image_url_lion}, "uuid": image_url_lion},
            ],
        }
    ],
)
print("Chat completion output:", chat_response.choices[0].message.content)
"""
ASSETS = "https://vllm-public-assets.s3.us-west-2.amazonaws.com"


def test_documented_vision_server(tiny_llava, tmp_path):
    hf, processor, path = tiny_llava
    model = greedy_copy(path, tmp_path / "model", MAX_TOKENS)
    images = {"boardwalk": image(31), "duck": image(32, (60, 40)), "lion": image(33)}
    media = tmp_path / "media"
    media.mkdir()
    for name, img in images.items():
        img.save(media / f"{name}.png")
    words = shlex.split(LAUNCH.replace("microsoft/Phi-3.5-vision-instruct", model))
    env = {"VLLM_CPU_KVCACHE_SPACE": "0.05", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    server = RemoteServer(words[2:], env=env)
    try:
        with http_folder(media) as base:
            names = {"microsoft/Phi-3.5-vision-instruct": model, "http://localhost:8000/v1": f"{server.base_url}/v1"}
            names |= {f"{ASSETS}/vision_model_images/boardwalk.jpg": f"{base}/boardwalk.png"}
            names |= {f"{ASSETS}/multimodal_asset/{n}.jpg": f"{base}/{n}.png" for n in ("duck", "lion")}
            server.wait_ready()
            out = run_script(CLIENT, names)
    finally:
        server.stop()
    requests = [
        ("user: What's in this image?<image>\nassistant:", [images["boardwalk"]]),
        ("user: What are the animals in these images?<image><image>\nassistant:", [images["duck"], images["lion"]]),
    ]
    want = [hf_text(hf, processor, p, i) for p, i in requests]
    assert out == "".join(f"Chat completion output: {w}\n" for w in want)
    assert want[0] != hf_text(hf, processor, "user: What's in this image?\nassistant:", [])  # the image steers it


def hf_text(hf, processor, prompt: str, images: list) -> str:
    """HF's greedy text, up to the tokenizer's end of sequence (where pagedllm stops)."""
    ids = hf_generate(hf, processor, prompt, images, MAX_TOKENS)
    eos = processor.tokenizer.eos_token_id
    return processor.tokenizer.decode(ids[: ids.index(eos) + 1] if eos in ids else ids, skip_special_tokens=True)
