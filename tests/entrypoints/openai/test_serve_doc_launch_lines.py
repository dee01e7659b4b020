"""The server launch lines of vLLM's quickstart and OpenAI-server pages, with only the command name changed
(`vllm` -> `pagedllm`, the hub model -> the bundled one, the template path -> a file), answer the pages' curl bodies
and openai-client calls (extra_body, content parts, guided_choice, X-Request-Id); several --api-key keys are each
accepted (key rotation). The test adds only --host/--port (a free port) and a small CPU
KV cache through the environment (room for one request of the full context, which a request without max_tokens
asks for, in float32 too: `--dtype auto` picks it on CPUs without bfloat16 instructions)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from conftest import RemoteServer

# the quickstart's and the OpenAI-server page's launch lines (the older module form too), `vllm` -> `pagedllm`
LAUNCH_LINES = [
    "vllm serve Qwen/Qwen2.5-1.5B-Instruct",
    "python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-1.5B-Instruct --generation-config vllm "
    "--api-key token-abc123 token-rotated",
    "vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123 "
    "--chat-template ./path-to-chat-template.jinja --enable-request-id-headers",
]
HUB_NAMES = ("Qwen/Qwen2.5-1.5B-Instruct", "NousResearch/Meta-Llama-3-8B-Instruct")
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" + (
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _post(base: str, path: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("line", LAUNCH_LINES)
def test_documented_server(smollm2, line, tmp_path):
    from openai import OpenAI

    (tmp_path / "template.jinja").write_text(TEMPLATE)
    line = line.replace("./path-to-chat-template.jinja", str(tmp_path / "template.jinja"))
    for hub in HUB_NAMES:
        line = line.replace(hub, smollm2)
    words = line.replace("vllm", "pagedllm").split()
    command = ("-m", "pagedllm", "serve") if words[0] == "pagedllm" else tuple(words[1:3])
    rest = words[2:] if words[0] == "pagedllm" else words[3:]
    server = RemoteServer(rest, command=command, env={"VLLM_CPU_KVCACHE_SPACE": "0.5"})
    keys = [None]
    if "--api-key" in rest:  # the values up to the next flag
        after = rest[rest.index("--api-key") + 1 :]
        keys = after[: next((i for i, w in enumerate(after) if w.startswith("--")), len(after))]
    try:
        server.wait_ready()
        base = server.base_url
        auth = {"Authorization": f"Bearer {keys[0]}"} if keys[0] else {}
        models = json.loads(urllib.request.urlopen(urllib.request.Request(base + "/v1/models", headers=auth)).read())
        name = models["data"][0]["id"]
        body = {"model": name, "prompt": "San Francisco is a", "max_tokens": 7, "temperature": 0}
        for key in keys:  # every key of --api-key is accepted
            status, completion = _post(base, "/v1/completions", body, key)
            assert status == 200 and completion["usage"]["completion_tokens"] <= 7
        if keys[0] is not None:
            assert _post(base, "/v1/completions", body, "wrong")[0] == 401
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "Who won the world series in 2020?"}]  # fmt: skip
        chat = {"model": name, "messages": messages}
        status, reply = _post(base, "/v1/chat/completions", chat | {"max_tokens": 8}, keys[-1])
        assert status == 200 and reply["choices"][0]["message"]["role"] == "assistant"
        client = OpenAI(api_key=keys[0] or "EMPTY", base_url=base + "/v1")
        completion = client.completions.create(model=name, prompt="San Francisco is a", max_tokens=5)
        assert completion.choices[0].text
        chat_response = client.chat.completions.create(model=name, messages=chat["messages"], max_tokens=5)
        assert chat_response.choices[0].message.content is not None
        if "--chat-template" in rest:
            _openai_server_page_calls(client, name)
    finally:
        server.stop()


def _openai_server_page_calls(client, name: str) -> None:
    """The OpenAI-compatible server page's client calls: extra_body parameters, content parts, guided_choice and
    X-Request-Id headers (--enable-request-id-headers)."""
    completion = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hello!"}],
                                                extra_body={"top_k": 50}, max_tokens=4)  # fmt: skip
    assert completion.choices[0].message.role == "assistant"
    parts = [{"type": "text", "text": "Classify this sentiment: vLLM is wonderful!"}]
    completion = client.chat.completions.create(model=name, messages=[{"role": "user", "content": parts}],
                                                max_tokens=4)  # fmt: skip
    assert completion.choices[0].finish_reason in ("stop", "length")
    sentiment = [{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}]
    completion = client.chat.completions.create(model=name, messages=sentiment,
                                                extra_body={"guided_choice": ["positive", "negative"]})  # fmt: skip
    assert completion.choices[0].message.content in ("positive", "negative")
    request_id = {"x-request-id": "sentiment-classification-00001"}
    completion = client.chat.completions.create(model=name, messages=sentiment, max_tokens=4,
                                                extra_headers=request_id)  # fmt: skip
    assert completion._request_id == "sentiment-classification-00001"
    completion = client.completions.create(model=name, prompt="A robot may not injure a human being", max_tokens=4,
                                           extra_headers={"x-request-id": "completion-test"})  # fmt: skip
    assert completion._request_id == "completion-test"
