"""/v1/chat/completions with image_url parts on the tiny LLaVA: the same greedy tokens as the offline LLM.chat, and
bad images (corrupt, too many for --limit-mm-per-prompt, on a text-only model) as 400s that leave the server up."""

from __future__ import annotations

import base64
import io

import pytest
from conftest import RemoteServer
from tiny_llava import image

from pagedllm import LLM, SamplingParams

pytest.importorskip("PIL")


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(*urls: str) -> list[dict]:
    parts = [{"type": "text", "text": "Look:"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "128", "--kv-cache-memory-bytes", "4194304"]


@pytest.fixture(scope="module")
def llava_server(tiny_llava):
    path = tiny_llava[2]
    server = RemoteServer(
        [path, "--served-model-name", "llava", *ENGINE, "--limit-mm-per-prompt", '{"image": 1}'], model="llava"
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def chat(server: RemoteServer, msgs: list[dict]) -> tuple[int, object]:
    body = {"model": "llava", "messages": msgs, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    return server.request("POST", "/v1/chat/completions", body, timeout=120)


def test_chat_with_an_image_matches_offline(llava_server, tiny_llava):
    img = image(21)
    status, body = chat(llava_server, messages(data_url(img)))
    assert status == 200, body
    llm = LLM(tiny_llava[2], dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    offline = llm.chat(messages(data_url(img)), params, use_tqdm=False)[0]
    assert body["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)  # the image's 4 tokens counted


@pytest.mark.parametrize(
    "urls, match",
    [
        (["data:image/png;base64," + base64.b64encode(b"garbage").decode()], "cannot be decoded"),
        ([data_url(image(1)), data_url(image(2))], "more than limit_mm_per_prompt['image']=1"),
        (["file:///etc/passwd"], "allowed local media directory"),
    ],
)
def test_bad_images_are_400(llava_server, urls, match):
    status, body = chat(llava_server, messages(*urls))
    assert status == 400, body
    assert match in body["error"]["message"]
    status, _ = chat(llava_server, messages(data_url(image(3))))
    assert status == 200  # still serving
