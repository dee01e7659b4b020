"""Bad requests get HTTP 400 (404 for an unknown model) with an OpenAI error body, never a 5xx, and the server keeps
serving; /tokenize and /detokenize; /metrics in Prometheus text with vLLM's metric names."""

from __future__ import annotations

import pytest

MODEL_NAME = "smollm2-test"  # conftest's --served-model-name
GOOD = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT_GOOD = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

BAD_COMPLETIONS = [  # (body changes, expected param or None)
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),  # over --max-n (16)
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary
    ({"prompt": [1, 2, 10**9]}, "prompt"),  # token id outside the vocabulary
    ({"prompt": [[5, 6], [-1]]}, "prompt"),
    ({"prompt": "hello " * 1100}, "prompt"),  # longer than max_model_len (1024)
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a"] * 300}, "prompt"),  # over --max-prompts (256)
    ({"prompt": None}, "prompt"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 50}, "prompt_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"seed": "abc"}, "seed"),
    ({"n": 2, "best_of": 3, "stream": True}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    # structured outputs: a bad constraint is refused with the field it came in
    ({"guided_json": {"type": "bogus"}}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_regex": "a+", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_grammar": "start: (", "guided_decoding_backend": "guidance"}, "guided_grammar"),
    ({"guided_regex": "a(b", "guided_decoding_backend": "guidance"}, "guided_regex"),
    (
        {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " ", "guided_decoding_backend": "xgrammar"},
        "guided_json",
    ),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),  # two constraints
    ({"structured_outputs": {"regex": "a+", "nonsense": 1}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"use_beam_search": True, "n": 2, "temperature": 0, "logprobs": 1}, "logprobs"),
    ({"use_beam_search": True, "n": 2, "temperature": 0, "stream": True}, "stream"),
    ({"use_beam_search": True, "n": 1, "temperature": 0}, "best_of"),  # one beam is no search
    ({"length_penalty": 0.5}, "length_penalty"),  # only with use_beam_search
    ({"early_stopping": True}, "early_stopping"),
    ({"frobnicate": 1}, "frobnicate"),  # unknown fields are named
    ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # not streamed: vLLM's 400, never ignored
    # caps (--max-stop 64, --max-bad-words 1024, --max-word-chars 1024)
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": "y" * 1025}, "stop"),
    ({"bad_words": [f"w{i}" for i in range(1025)]}, "bad_words"),
    ({"bad_words": ["z" * 1025]}, "bad_words"),
    ({"cache_salt": ""}, "cache_salt"),
]

BAD_CHATS = [
    ({"messages": "hello"}, "messages"),  # not a list
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs=true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"temperature": -0.5}, "temperature"),
    ({"max_completion_tokens": -1}, "max_tokens"),
    ({"chat_template": "{{ 'x' }}"}, None),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}}, "response_format"),
    ({"use_beam_search": True, "n": 2, "temperature": 0, "logprobs": True}, "logprobs"),
    ({"documents": [{"text": "a"}], "chat_template_kwargs": {"documents": []}}, "documents"),
    ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": True, "frobnicate": 1}, "frobnicate"),
]


def _assert_error(status: int, body, expected_status: int = 400, param: str | None = None) -> None:
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


def _assert_still_serving(server) -> None:
    status, body = server.request("POST", "/v1/completions", GOOD)
    assert status == 200 and body["choices"][0]["text"]


@pytest.mark.parametrize("change,param", BAD_COMPLETIONS, ids=[str(c) for c, _ in BAD_COMPLETIONS])
def test_bad_completion_is_400(server, change, param):
    body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    _assert_error(*server.request("POST", "/v1/completions", body), param=param)


@pytest.mark.parametrize("change,param", BAD_CHATS, ids=[str(c) for c, _ in BAD_CHATS])
def test_bad_chat_is_400(server, change, param):
    _assert_error(*server.request("POST", "/v1/chat/completions", {**CHAT_GOOD, **change}), param=param)


def test_malformed_bodies_and_unknown_model(server):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        _assert_error(*server.request("POST", path, b'{"prompt": "x",'))  # malformed JSON
        _assert_error(*server.request("POST", path, b"[1, 2]"))  # not an object
        _assert_error(*server.request("POST", path, {}))  # required fields missing
    _assert_error(*server.request("POST", "/v1/completions", {**GOOD, "model": "gpt-5"}), 404, "model")
    _assert_error(*server.request("POST", "/v1/chat/completions", {**CHAT_GOOD, "model": "gpt-5"}), 404, "model")
    big = {**GOOD, "prompt": "x" * (1 << 20)}  # over --max-body-bytes (1 MiB)
    _assert_error(*server.request("POST", "/v1/completions", big))
    # this server runs a generative model: embeddings are refused
    _assert_error(*server.request("POST", "/v1/embeddings", {"input": "hello"}))
    _assert_error(*server.request("GET", "/no/such/route"), 404)
    _assert_still_serving(server)


def test_openai_client_raises_bad_request(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi")
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices[0].text


def test_tokenize_detokenize(server, offline_llm):
    tok = offline_llm.get_tokenizer()
    status, body = server.request("POST", "/tokenize", {"prompt": "Hello world, how are you?"})
    assert status == 200 and body["tokens"] == tok.encode("Hello world, how are you?")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    status, body = server.request("POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["prompt"] == "Hello world, how are you?"
    messages = [{"role": "user", "content": "Hi"}]
    expected = offline_llm.chat(messages, use_tqdm=False)[0].prompt_token_ids
    assert server.request("POST", "/tokenize", {"messages": messages})[1]["tokens"] == expected
    _assert_error(*server.request("POST", "/detokenize", {"tokens": [10**9]}), param="tokens")
    _assert_error(*server.request("POST", "/tokenize", {"prompt": "x", "messages": messages}))


METRIC_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count",
]


def test_metrics_exposition(server):
    _assert_still_serving(server)
    status, text = server.request("GET", "/metrics", auth=False)
    assert status == 200
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            samples.setdefault(name_labels.split("{")[0], []).append((name_labels, float(value)))
    for name in METRIC_NAMES:
        assert name in samples, name
    assert "# TYPE vllm:prompt_tokens_total counter" in text  # prometheus-client's layout
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert samples["vllm:generation_tokens_total"][0][1] >= 2
    buckets = [v for _, v in samples["vllm:e2e_request_latency_seconds_bucket"]]
    assert buckets == sorted(buckets) and buckets[-1] == samples["vllm:e2e_request_latency_seconds_count"][0][1]
    assert 'le="+Inf"' in samples["vllm:e2e_request_latency_seconds_bucket"][-1][0]
    assert f'model_name="{MODEL_NAME}"' in samples["vllm:num_requests_running"][0][0]
