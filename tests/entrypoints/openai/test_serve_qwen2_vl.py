"""/v1/chat/completions on the tiny Qwen2-VL with image_url and video_url parts: the same greedy text as the
offline LLM.chat; a corrupt video and too many videos for --limit-mm-per-prompt are 400s that leave it serving."""

from __future__ import annotations

import base64

import pytest
from conftest import RemoteServer
from test_serve_multimodal import ENGINE, data_url
from tiny_qwen2_vl import image, mp4_data_url, save_tiny_qwen2_vl, video

from pagedllm import LLM, SamplingParams

pytest.importorskip("PIL")
pytest.importorskip("av")


def mp4_url(seed: int) -> str:
    return mp4_data_url(video(seed, 4))


def messages(*parts: tuple[str, str]) -> list[dict]:
    content = [{"type": "text", "text": "Look:"}] + [{"type": kind, kind: {"url": url}} for kind, url in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return save_tiny_qwen2_vl(tmp_path_factory)


@pytest.fixture(scope="module")
def qwen_server(tiny_qwen):
    limits = '{"image": 1, "video": 1}'
    server = RemoteServer([tiny_qwen[2], "--served-model-name", "qwen", *ENGINE, "--limit-mm-per-prompt", limits])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def chat(server: RemoteServer, msgs: list[dict]) -> tuple[int, object]:
    body = {"model": "qwen", "messages": msgs, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    return server.request("POST", "/v1/chat/completions", body, timeout=120)


def test_chat_with_an_image_and_a_video_matches_offline(qwen_server, tiny_qwen):
    msgs = messages(("image_url", data_url(image(21))), ("video_url", mp4_url(3)))
    status, body = chat(qwen_server, msgs)
    assert status == 200, body
    llm = LLM(tiny_qwen[2], dtype="float32", device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    offline = llm.chat(msgs, params, use_tqdm=False)[0]
    assert body["choices"][0]["message"]["content"] == offline.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)


@pytest.mark.parametrize(
    "parts, match",
    [
        ([("video_url", "data:video/mp4;base64," + base64.b64encode(b"garbage").decode())], "cannot be decoded"),
        ([("video_url", mp4_url(1)), ("video_url", mp4_url(2))], "more than limit_mm_per_prompt['video']=1"),
    ],
)
def test_bad_videos_are_400(qwen_server, parts, match):
    status, body = chat(qwen_server, messages(*parts))
    assert status == 400, body
    assert match in body["error"]["message"]
    status, _ = chat(qwen_server, messages(("video_url", mp4_url(4))))
    assert status == 200  # still serving
