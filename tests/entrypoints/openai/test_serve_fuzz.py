"""Random request bodies against the real server: a good body with one field set to a random value (right or wrong
type, out of range, NaN, huge ints, odd messages), or bodies made wholly of random fields. Every answer is 200, 400
or 404 with an OpenAI error body, never a 5xx, and the server keeps serving."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL_NAME = "smollm2-test"  # conftest's --served-model-name
JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6))
JSON = st.recursive(
    JSON_SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
SMALL_INT = st.integers(-3, 4)
NUMBER = st.one_of(st.floats(), st.integers(-3, 3))
TOKEN_IDS = st.lists(st.integers(-3, 60000), max_size=4)

SAMPLING = {
    "model": st.sampled_from([MODEL_NAME, "other", ""]) | JSON_SCALAR,
    "max_tokens": SMALL_INT | JSON_SCALAR,
    "n": SMALL_INT,
    "best_of": SMALL_INT | st.none(),
    "temperature": NUMBER | JSON_SCALAR,
    "top_p": NUMBER,
    "top_k": SMALL_INT,
    "min_p": NUMBER,
    "presence_penalty": NUMBER,
    "repetition_penalty": NUMBER,
    "seed": JSON_SCALAR,
    "stop": st.lists(st.text(max_size=3), max_size=2) | JSON_SCALAR,
    "logit_bias": st.dictionaries(st.text(max_size=5), NUMBER, max_size=2) | JSON,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON_SCALAR,
    "min_tokens": SMALL_INT,
    "ignore_eos": st.booleans() | JSON_SCALAR,
}
COMPLETION_FIELDS = {
    **SAMPLING,
    "prompt": st.text(max_size=20) | TOKEN_IDS | st.lists(st.text(max_size=5) | TOKEN_IDS, max_size=3) | JSON,
    "echo": st.booleans(),
    "logprobs": st.integers(-2, 25) | JSON_SCALAR,
    "prompt_logprobs": st.integers(-2, 25),
}
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "assistant", "system", "tool", "x"]) | JSON_SCALAR,
        "content": st.text(max_size=10)
        | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": JSON}))
        | JSON,
    },
)
CHAT_FIELDS = {
    **SAMPLING,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "logprobs": st.booleans() | JSON_SCALAR,
    "top_logprobs": st.integers(-2, 25),
    "tools": st.lists(st.dictionaries(st.text(max_size=4), JSON, max_size=2), max_size=2) | JSON_SCALAR,
    "chat_template_kwargs": st.dictionaries(st.text(max_size=8), JSON, max_size=2) | JSON_SCALAR,
}
GOOD_COMPLETION = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 2}
GOOD_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _bodies(good: dict, fields: dict):
    """A good body with one field replaced by a random value, or a body of random fields only."""
    one_field = st.sampled_from(sorted(fields)).flatmap(lambda k: fields[k].map(lambda v: {**good, k: v}))
    return one_field | st.fixed_dictionaries({}, optional=fields)


ENDPOINTS = st.one_of(
    st.tuples(st.just("/v1/completions"), _bodies(GOOD_COMPLETION, COMPLETION_FIELDS)),
    st.tuples(st.just("/v1/chat/completions"), _bodies(GOOD_CHAT, CHAT_FIELDS)),
    st.tuples(st.just("/tokenize"), st.fixed_dictionaries({}, optional={"prompt": JSON, "messages": JSON})),
    st.tuples(st.just("/detokenize"), st.fixed_dictionaries({}, optional={"tokens": TOKEN_IDS | JSON})),
    st.tuples(st.just("/v1/embeddings"), st.fixed_dictionaries({}, optional={"input": JSON})),
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=ENDPOINTS)
def test_random_bodies_never_5xx(server, case):
    path, body = case
    if path == "/v1/chat/completions":
        body.setdefault("max_completion_tokens", 3)  # a chat without a limit may run to max_model_len
    status, answer = server.request("POST", path, body, timeout=120)
    assert status in (200, 400, 404), (path, body, status, answer)
    if status != 200:
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
