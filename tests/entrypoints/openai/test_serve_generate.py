"""`pagedllm serve` driven by the official openai client: greedy completions and chats equal to the offline LLM's,
streaming equal to non-streaming, usage counts, echo + logprobs equal to offline prompt_logprobs (lm-eval's
loglikelihood request), chat logprobs, 16 concurrent clients, and abort when a client disconnects."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import struct
import time

import pytest

from pagedllm import SamplingParams

MODEL_NAME = "smollm2-test"  # conftest's --served-model-name
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_models_health_version(server, client):
    assert server.model == MODEL_NAME
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert server.request("GET", "/health", auth=False)[0] == 200  # no key needed
    status, body = server.request("GET", "/version")
    assert status == 200 and body["version"]


def test_api_key_required(server):
    import openai

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
        status, body = server.request("POST", "/v1/completions", {"prompt": "hi"}, auth=False, headers=headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert server.request("GET", "/v1/models", auth=False)[0] == 401
    assert server.request("GET", "/metrics", auth=False)[0] == 200
    bad_client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()


def test_greedy_completions_equal_offline(client, offline_llm):
    expected = offline_llm.generate(PROMPTS, _greedy(16), use_tqdm=False)
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == MODEL_NAME
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in resp.choices] == [o.outputs[0].finish_reason for o in expected]
    num_prompt = sum(len(o.prompt_token_ids) for o in expected)
    num_generated = sum(len(o.outputs[0].token_ids) for o in expected)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (num_prompt, num_generated)
    assert resp.usage.total_tokens == num_prompt + num_generated
    # the same prompts as token ids (one list, and a list of lists)
    ids = [o.prompt_token_ids for o in expected]
    one = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=16, temperature=0)
    assert one.choices[0].text == expected[0].outputs[0].text
    many = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=16, temperature=0)
    assert [c.text for c in many.choices] == [o.outputs[0].text for o in expected]


def test_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[" the"])
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.id == full.id or c.id.startswith("cmpl-") for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and " the" not in text  # no part of the stop string ever streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_equals_offline_and_streams(client, offline_llm):
    expected = offline_llm.chat(CHAT, _greedy(24), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.outputs[0].text
    assert resp.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=24, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_echo_logprobs_equal_offline_prompt_logprobs(client, offline_llm):
    prompt = "The quick brown fox jumps over the lazy dog"
    ref = offline_llm.generate([prompt], _greedy(1, prompt_logprobs=1), use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    expected = [None] + [ref.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    # lm-eval's local-completions loglikelihood: echo, logprobs, max_tokens 0 (or 1)
    for max_tokens in (0, 1):
        resp = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
        )
        lp = resp.choices[0].logprobs
        assert resp.choices[0].text.startswith(prompt)
        assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected[1:], abs=1e-4)
        assert "".join(lp.tokens[: len(ids)]) == prompt
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert resp.usage.completion_tokens == max_tokens


def test_chat_logprobs_equal_offline(client, offline_llm):
    expected = offline_llm.chat(CHAT, _greedy(8, logprobs=3), use_tqdm=False)[0].outputs[0]
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids)
    for entry, token_id, offline in zip(content, expected.token_ids, expected.logprobs):
        assert entry.logprob == pytest.approx(offline[token_id].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the top token


def test_16_concurrent_requests(server, offline_llm):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(16)]
    expected = [o.outputs[0].text for o in offline_llm.generate(prompts, _greedy(12), use_tqdm=False)]

    async def run() -> list[str]:
        client = server.async_client()

        async def one(i: int) -> str:
            if i % 2:  # half of them stream
                stream = await client.completions.create(
                    model=MODEL_NAME, prompt=prompts[i], max_tokens=12, temperature=0, stream=True
                )
                return "".join([c.choices[0].text async for c in stream if c.choices])
            resp = await client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=12, temperature=0)
            return resp.choices[0].text

        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await client.close()

    assert asyncio.run(run()) == expected


def _metric(server, name: str) -> float:
    text = server.request("GET", "/metrics", auth=False)[1]
    line = next(x for x in text.splitlines() if x.startswith(name + "{") or x.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


def _wait_idle(server, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = _metric(server, "vllm:num_requests_running")
        if running == 0 and _metric(server, "vllm:kv_cache_usage_perc") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the request was not aborted: it still runs or holds KV-cache blocks")


def _open(server, body: dict, timeout: float) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    headers = {"Content-Type": "application/json", **server.headers()}
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=headers)
    return conn


def test_disconnect_aborts_streaming_and_non_streaming(server):
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True}
    _wait_idle(server)
    conn = _open(server, {**body, "stream": True}, timeout=60)
    resp = conn.getresponse()
    assert resp.status == 200
    data = []
    while len(data) < 4:
        line = resp.fp.readline().decode().strip()
        if line.startswith("data: "):
            data.append(json.loads(line[6:]))
    assert data[0]["choices"][0]["finish_reason"] is None
    assert _metric(server, "vllm:num_requests_running") == 1
    assert _metric(server, "vllm:kv_cache_usage_perc") > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    _wait_idle(server)  # the closed stream aborted its request and freed its blocks
    conn = _open(server, body, timeout=1.5)
    with pytest.raises(TimeoutError):
        conn.getresponse()
    # a reset, not a FIN: a client that only half-closes its socket still gets its answer (a FIN says no more than
    # "nothing more to send"), so a non-streaming request is aborted when its connection is reset
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()
    _wait_idle(server)
