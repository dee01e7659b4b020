"""/v1/chat/completions on the tiny Gemma 3 with an image_url data URL: the greedy tokens of HF's generate on the
rendered prompt, and the same text as the offline LLM.chat; too many images for --limit-mm-per-prompt is a 400
that leaves it serving."""

from __future__ import annotations

import pytest
from conftest import RemoteServer
from test_serve_multimodal import ENGINE, data_url, messages
from tiny_gemma3 import hf_generate, image

from pagedllm import LLM, SamplingParams

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def gemma_server(tiny_gemma3):
    server = RemoteServer(
        [tiny_gemma3[2], "--served-model-name", "gemma", *ENGINE, "--limit-mm-per-prompt", '{"image": 1}']
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def chat(server: RemoteServer, msgs: list[dict]) -> tuple[int, object]:
    body = {"model": "gemma", "messages": msgs, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    return server.request("POST", "/v1/chat/completions", body, timeout=120)


def test_chat_with_an_image_matches_hf_and_offline(gemma_server, tiny_gemma3):
    hf, processor, path = tiny_gemma3
    msgs = messages(data_url(image(21)))
    status, body = chat(gemma_server, msgs)
    assert status == 200, body
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    offline = llm.chat(msgs, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    want = hf_generate(hf, processor, "user: Look:<start_of_image>\nassistant:", [image(21)], 5)
    assert list(offline.outputs[0].token_ids) == want
    assert body["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)  # "\n\n<boi>" + 4 + "<eoi>\n\n" counted


def test_too_many_images_is_400(gemma_server):
    status, body = chat(gemma_server, messages(data_url(image(1)), data_url(image(2))))
    assert status == 400, body
    assert "more than limit_mm_per_prompt['image']=1" in body["error"]["message"]
    status, _ = chat(gemma_server, messages(data_url(image(3))))
    assert status == 200  # still serving
