"""vLLM's server flags and request fields: several served names, --response-role, --return-tokens-as-token-ids
(a request may turn it off), --enable-force-include-usage, --disable-fastapi-docs, and `priority` (only 0),
`request_id` (the response's id), --enable-request-id-headers (the X-Request-Id header names the response too),
`"n": null` (the default, 1)."""

from __future__ import annotations

import http.client
import json

import pytest
from conftest import RemoteServer

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def flag_server(smollm2):
    server = RemoteServer(
        [smollm2, "--served-model-name", "first", "second", "--max-model-len", "128", "--dtype", "float32"]
        + ["--kv-cache-memory-bytes", str(16 << 20), "--response-role", "bot", "--return-tokens-as-token-ids"]
        + ["--enable-force-include-usage", "--disable-fastapi-docs", "--disable-uvicorn-access-log"]
        + ["--enable-prompt-tokens-details", "--tokenizer-pool-size", "2", "--enable-request-id-headers"]
        + ["--enable-server-load-tracking", "--disable-frontend-multiprocessing", "--enable-chunked-prefill=true"]
        + ["--h11-max-incomplete-event-size", str(8 << 20), "--default-chat-template-kwargs", '{"unused": 1}'],
        model="first",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_names_role_and_token_ids(flag_server, smollm2):
    status, models = flag_server.request("GET", "/v1/models")
    assert [m["id"] for m in models["data"]] == ["first", "second"] and models["data"][0]["root"] == smollm2
    status, body = flag_server.request("POST", "/v1/chat/completions", {**CHAT, "model": "second", "logprobs": True})
    assert status == 200 and body["model"] == "second" and body["choices"][0]["message"]["role"] == "bot"
    assert all(e["token"].startswith("token_id:") for e in body["choices"][0]["logprobs"]["content"])
    off = {"model": "first", "prompt": "Hi", "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": False}
    status, body = flag_server.request("POST", "/v1/completions", off)
    assert status == 200 and not any(t.startswith("token_id:") for t in body["choices"][0]["logprobs"]["tokens"])
    status, body = flag_server.request("POST", "/v1/chat/completions", {**CHAT, "add_generation_prompt": False})
    assert status == 200 and body["choices"][0]["message"]["role"] == "user"  # the last message's role


def test_usage_forced_docs_off_and_priority(flag_server):
    status, text = flag_server.request("POST", "/v1/chat/completions", {**CHAT, "stream": True})
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert status == 200 and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
    assert flag_server.request("GET", "/openapi.json")[0] == 404
    conn = http.client.HTTPConnection("127.0.0.1", flag_server.port, timeout=30)
    ids = []
    for headers in ({"X-Request-Id": "abc-1"}, {}):
        conn.request("GET", "/v1/models", headers=headers)
        response = conn.getresponse()
        response.read()
        ids.append(response.getheader("x-request-id"))
    conn.close()
    assert ids[0] == "abc-1" and len(ids[1]) == 32  # the client's, else a new one
    stream = flag_server.client().completions.create(
        model="first", prompt="Hi", max_tokens=60, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # the first chunk came: the request is in flight
    assert flag_server.request("GET", "/load") == (200, {"server_load": 1})
    assert len(list(stream)) > 1 and flag_server.request("GET", "/load") == (200, {"server_load": 0})
    status, body = flag_server.request("POST", "/v1/chat/completions", {**CHAT, "priority": 0, "request_id": "r-7"})
    assert status == 200 and body["id"] == "chatcmpl-r-7"
    status, body = flag_server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "request_id": ""})
    assert status == 400 and body["error"]["param"] == "request_id"
    status, body = flag_server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 3})
    assert status == 400 and body["error"]["param"] == "priority" and "priority=3" in body["error"]["message"]


def test_request_id_header_names_the_response(flag_server):
    for path, body, prefix in (
        ("/v1/chat/completions", CHAT, "chatcmpl"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "request_id": "from-body"}, "cmpl"),  # the header wins
    ):
        for stream in (False, True):
            header = f"hdr-{prefix}-{stream}"
            status, body_out = flag_server.request(
                "POST", path, {**body, "stream": stream}, headers={"X-Request-Id": header}
            )
            assert status == 200, body_out
            if stream:
                ids = {json.loads(line[6:])["id"] for line in body_out.splitlines() if line.startswith("data: {")}
                assert ids == {f"{prefix}-{header}"}, ids
            else:
                assert body_out["id"] == f"{prefix}-{header}", body_out
    status, body = flag_server.request("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert status == 200 and body["id"].startswith("cmpl-") and len(body["id"]) == 37  # no header: a random id
    status, body = flag_server.request("POST", "/v1/completions", {"prompt": "Hi"}, headers={"X-Request-Id": "x" * 300})
    assert status == 400 and body["error"]["param"] == "X-Request-Id", body


def test_n_null_is_one(flag_server):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "Hi", "max_tokens": 2})):
        status, out = flag_server.request("POST", path, {**body, "n": None})
        assert status == 200 and len(out["choices"]) == 1, out


def test_default_chat_template_kwargs_under_the_request_ones():
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.serving_chat import _template_kwargs

    state = SimpleNamespace(default_chat_template_kwargs={"enable_thinking": False, "lang": "en"})
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], chat_template_kwargs={"lang": "fr"})
    assert _template_kwargs(state, req) == {"enable_thinking": False, "lang": "fr"}
    docs = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], documents=[{"text": "d"}])
    assert _template_kwargs(SimpleNamespace(default_chat_template_kwargs={}), docs) == {"documents": [{"text": "d"}]}
    plain = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    assert _template_kwargs(SimpleNamespace(default_chat_template_kwargs={}), plain) is None
