"""The quickstart's server launch lines of vLLM's documents, with only the command name changed (`vllm` ->
`pagedllm`, the hub model -> the bundled one), answer the quickstart's curl bodies and openai-client calls; several
--api-key keys are each accepted (key rotation). The test adds only --host/--port (a free port) and a small CPU
KV cache through the environment."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from conftest import RemoteServer

# the quickstart's server launch lines (the older module form too), `vllm` -> `pagedllm`
LAUNCH_LINES = [
    "vllm serve Qwen/Qwen2.5-1.5B-Instruct",
    "python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-1.5B-Instruct --generation-config vllm "
    "--api-key token-abc123 token-rotated",
]


def _post(base: str, path: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("line", LAUNCH_LINES)
def test_quickstart_server(smollm2, line):
    from openai import OpenAI

    words = line.replace("vllm", "pagedllm").replace("Qwen/Qwen2.5-1.5B-Instruct", smollm2).split()
    command = ("-m", "pagedllm", "serve") if words[0] == "pagedllm" else tuple(words[1:3])
    rest = words[2:] if words[0] == "pagedllm" else words[3:]
    server = RemoteServer(rest, command=command, env={"VLLM_CPU_KVCACHE_SPACE": "0.05"})
    keys = rest[rest.index("--api-key") + 1 :] if "--api-key" in rest else [None]
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
    finally:
        server.stop()
