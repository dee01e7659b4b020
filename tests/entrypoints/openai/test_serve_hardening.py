"""The server end to end on what it must not drop or choke on: cache_salt, chat echo, prompt_logprobs, token ids as
logprob tokens, continuous usage, GET /v1/models/{id}, max_tokens beyond the context, malformed text and nesting,
caps, a half-closed socket, Prometheus' own parser on /metrics; and a server started as
`python -m pagedllm.entrypoints.openai.api_server` with its key from VLLM_API_KEY, which exits 0 after Ctrl-C."""

from __future__ import annotations

import json
import signal
import socket
import uuid

import pytest
from conftest import RemoteServer

from pagedllm import SamplingParams

MODEL_NAME = "smollm2-test"  # conftest's --served-model-name
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # ~80 tokens: 5 full blocks of 16


def _completion(server, **body) -> dict:
    status, out = server.request("POST", "/v1/completions", {"model": MODEL_NAME, "max_tokens": 1, **body})
    assert status == 200, out
    return out


def _cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_separates_prefix_cache(server):
    salt_a, salt_b = f"a-{uuid.uuid4()}", f"b-{uuid.uuid4()}"
    first = _completion(server, prompt=LONG_PROMPT, cache_salt=salt_a)
    assert _cached(first) == 0
    assert _cached(_completion(server, prompt=LONG_PROMPT, cache_salt=salt_a)) >= 64  # equal salts share blocks
    assert _cached(_completion(server, prompt=LONG_PROMPT, cache_salt=salt_b)) == 0  # another tenant: none
    messages = [{"role": "user", "content": LONG_PROMPT}]
    chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1, "cache_salt": salt_a}
    for expect_hit in (False, True):
        status, out = server.request("POST", "/v1/chat/completions", chat)
        assert status == 200 and (_cached(out) >= 64) == expect_hit, out
    status, out = server.request("POST", "/v1/chat/completions", {**chat, "cache_salt": salt_b})
    assert status == 200 and _cached(out) == 0


def test_chat_echo_prompt_logprobs_and_token_ids(server, offline_llm):
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite is"}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 3, "temperature": 0, "echo": True}
    body.update(add_generation_prompt=False, continue_final_message=True, logprobs=True)
    body.update(return_tokens_as_token_ids=True, prompt_logprobs=1)
    status, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, out
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1)
    offline = offline_llm.chat(
        messages, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False
    )[0]
    choice = out["choices"][0]
    assert choice["message"]["content"] == "My favourite is" + offline.outputs[0].text  # vLLM's echo
    assert [t["token"] for t in choice["logprobs"]["content"]] == [
        f"token_id:{t}" for t in offline.outputs[0].token_ids
    ]
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(offline.prompt_token_ids)
    for entry, token_id, expected in zip(
        out["prompt_logprobs"][1:], offline.prompt_token_ids[1:], offline.prompt_logprobs[1:]
    ):
        assert entry[str(token_id)]["logprob"] == pytest.approx(expected[token_id].logprob, abs=1e-3)
    # with a generation prompt the reply's role is the assistant's, not the last message's (user): nothing echoed
    body = {"model": MODEL_NAME, "messages": messages[:1], "max_tokens": 2, "temperature": 0, "echo": True}
    status, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 200 and not out["choices"][0]["message"]["content"].startswith("Name a color.")


def test_streamed_echo_and_continuous_usage(client):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True},
        )
    )
    assert chunks[1].choices[0].delta.content == "Hello"  # after the role chunk
    assert all(c.usage is not None for c in chunks)
    generated = [c.usage.completion_tokens for c in chunks]
    assert generated == sorted(generated) and generated[-1] == 3 and generated[0] == 0
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_beam_search_equals_offline(server, offline_llm):
    prompt = "The best thing about Paris is"
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=4, length_penalty=0.5)
    offline = offline_llm.generate(prompt, params, use_tqdm=False)[0].outputs
    body = {"n": 2, "best_of": 3, "use_beam_search": True, "temperature": 0, "max_tokens": 4, "length_penalty": 0.5}
    out = _completion(server, prompt=prompt, **body)
    assert [c["text"] for c in out["choices"]] == [o.text for o in offline]
    assert out["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in offline)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], **body}
    status, out = server.request("POST", "/v1/chat/completions", chat)
    messages = [{"role": "user", "content": "Hi"}]
    offline = offline_llm.chat(messages, params, use_tqdm=False)[0].outputs
    assert status == 200, out
    assert [c["message"]["content"] for c in out["choices"]] == [o.text for o in offline]


def test_models_retrieve(client):
    import openai

    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_max_tokens_beyond_context_is_400(server):
    messages = [{"role": "user", "content": LONG_PROMPT}]
    for path, body in [("/v1/completions", {"prompt": LONG_PROMPT}), ("/v1/chat/completions", {"messages": messages})]:
        n = server.request("POST", "/tokenize", body)[1]["count"]
        status, out = server.request("POST", path, {**body, "model": MODEL_NAME, "max_tokens": 1024 - n + 1})
        assert status == 400, out
        assert out["error"]["message"] == (
            f"This model's maximum context length is 1024 tokens. However, you requested 1025 tokens ({n} in the "
            f"messages, {1024 - n + 1} in the completion). Please reduce the length of the messages or completion."
        )


def test_far_too_long_prompt_is_refused_before_tokenizing(server):
    text = "lorem ipsum " * 80_000  # 960 KB (under the test server's 1 MiB body cap), ~160k tokens
    for path, body in [
        ("/v1/completions", {"prompt": text}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
    ]:
        status, out = server.request("POST", path, {**body, "model": MODEL_NAME})
        assert status == 400 and "characters are far more than max_model_len=1024 tokens" in out["error"]["message"], (
            out
        )


DEEP = "[" * 70 + "]" * 70  # nested past the limit (64)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model"),
        ("/v1/completions", b'{"prompt": "x \\udc00"}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/embeddings", b'{"input": "\\ud800"}', "input"),
        ("/v1/chat/completions", b'{"messages": [], "chat_template_kwargs": {"x": %s}}' % DEEP.encode(), None),
        (
            "/v1/chat/completions",
            b'{"messages": [], "tools": [{"function": {"parameters": %s}}]}' % DEEP.encode(),
            None,
        ),
    ],
)
def test_surrogates_and_deep_nesting_are_400(server, path, body, param):
    status, out = server.request("POST", path, body)
    assert status == 400, out
    if param is None:
        assert "nested more than 64 levels" in out["error"]["message"]
    else:
        assert out["error"]["param"] == param and "surrogate" in out["error"]["message"]


def test_half_closed_socket_gets_its_answer(server):
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    )
    head += f"Authorization: Bearer {server.api_key}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(head.encode() + body)
        s.shutdown(socket.SHUT_WR)  # "nothing more from me"
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 2


def test_metrics_parse_with_prometheus_client(server):
    parser = pytest.importorskip("prometheus_client.parser")
    _completion(server, prompt="Hi")
    text = server.request("GET", "/metrics", auth=False)[1]
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for name in ("prompt_tokens", "generation_tokens", "request_success", "prefix_cache_queries"):
        family = families[f"vllm:{name}"]
        assert family.type == "counter" and family.samples, name
        assert all(s.name == f"vllm:{name}_total" for s in family.samples)
    assert families["vllm:generation_tokens"].samples[0].value >= 1
    assert families["vllm:e2e_request_latency_seconds"].type == "histogram"
    assert all(f.type != "unknown" for f in families.values())


def test_api_server_module_env_key_and_clean_ctrl_c(smollm2):
    server = RemoteServer(
        ["--model", smollm2, "--served-model-name", "m", "--max-model-len", "64"],
        command=("-m", "pagedllm.entrypoints.openai.api_server"),
        env={"VLLM_API_KEY": "from-env"},
    )
    try:
        server.wait_ready()
        assert server.request("GET", "/v1/models")[0] == 401
        status, out = server.request("GET", "/v1/models/m", headers={"Authorization": "Bearer from-env"})
        assert status == 200 and out["id"] == "m"
        server.proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert server.proc.wait(30) == 0
        assert "Traceback" not in server.read_log() and "KeyboardInterrupt" not in server.read_log()
    finally:
        server.stop()
