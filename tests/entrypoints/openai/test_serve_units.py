"""The server's parts in process, without a model: the API-key sources, the body guard (nesting depth, lone
surrogates), and that a request's preparation (tokenizing, the engine's checks) and /metrics, /health, /tokenize never
wait for the engine thread, checked with a fake engine whose thread is held busy."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedllm.entrypoints.openai.async_engine import AsyncEngine  # noqa: E402
from pagedllm.entrypoints.openai.body_checks import BodyError, check_body  # noqa: E402
from pagedllm.entrypoints.openai.launcher import resolve_api_key  # noqa: E402
from pagedllm.entrypoints.openai.limits import MAX_JSON_DEPTH  # noqa: E402
from pagedllm.entrypoints.openai.serving_utils import ServerState  # noqa: E402
from pagedllm.metrics import Counter  # noqa: E402


def test_api_key_sources():
    env = {"VLLM_API_KEY": "v", "PAGEDLLM_API_KEY": "p"}
    assert resolve_api_key("flag", env) == "flag"  # --api-key wins
    assert resolve_api_key(None, env) == "p"
    assert resolve_api_key(None, {"VLLM_API_KEY": "v"}) == "v"
    assert resolve_api_key(None, {"VLLM_API_KEY": "", "PAGEDLLM_API_KEY": ""}) is None
    assert resolve_api_key(None, {}) is None


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "body,param",
    [
        ({"chat_template_kwargs": {"x": _nested(MAX_JSON_DEPTH)}}, "chat_template_kwargs"),
        ({"tools": [{"function": {"parameters": _nested(600)}}]}, "tools"),
        ({"messages": [{"tool_calls": [{"function": {"arguments": json.dumps(_nested(600))}}]}]}, "messages"),
        ({"model": "\ud800"}, "model"),
        ({"messages": [{"role": "user", "content": "ok \udfff"}]}, "messages"),
        ({"prompt": ["fine", "\ud83d"]}, "prompt"),
    ],
)
def test_body_guard_refuses(body, param):
    with pytest.raises(BodyError) as info:
        check_body(json.dumps(body).encode())
    assert info.value.param == param
    assert (str(MAX_JSON_DEPTH) in str(info.value)) == ("nested" in str(info.value))


def test_body_guard_passes():
    check_body(json.dumps({"x": _nested(MAX_JSON_DEPTH - 2), "emoji": "\U0001f600 \\ud800"}).encode())
    check_body(b'{"prompt": "\\ud800')  # not JSON: left to the app's parser (its 400 names the JSON error)
    check_body(json.dumps({"messages": [{"tool_calls": [{"function": {"arguments": "[" * 100}}]}]}).encode())


class _Tokenizer:
    def __init__(self) -> None:
        self.threads: list[str] = []
        self.special: list[bool] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        self.special.append(add_special_tokens)
        return [ord(c) % 50 for c in text]

    def get_vocab(self) -> dict[str, int]:
        return {chr(97 + i) * 2: i for i in range(50)}  # the longest entry has 2 characters


class _Engine:
    """What the server reads of an LLMEngine; make_request refuses every prompt (so nothing needs to run)."""

    def __init__(self) -> None:
        model = SimpleNamespace(max_model_len=64, model_path="fake", vocab_size=50)
        self.config = SimpleNamespace(model=model)
        self.default_sampling_fields: dict = {}
        self.checked_on: list[str] = []

    def step(self):  # makes the server treat it as generative
        raise AssertionError("nothing is ever admitted")

    def has_unfinished_requests(self) -> bool:
        return False

    def make_request(self, prompt, token_ids, params, request_id, cache_salt=None, **kwargs):
        self.checked_on.append(threading.current_thread().name)
        raise ValueError(f"prompt length {len(token_ids)} is refused by this fake engine")

    def get_metrics(self):
        return [Counter("vllm:prompt_tokens", {"model_name": "fake"}, 7)]


async def _asgi(app, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    """One HTTP exchange with the ASGI app in this event loop: (status, body text)."""
    data = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path}
    scope.update(raw_path=path.encode(), query_string=b"", headers=headers, scheme="http", server=("t", 80))
    sent, status, chunks = False, 0, []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the client waits for the answer

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        else:
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks).decode()


async def _while_engine_busy(app, engine: AsyncEngine) -> list:
    gate = threading.Event()
    busy = asyncio.ensure_future(engine.call(gate.wait))  # holds the engine thread (a long step, say)
    try:
        calls = [
            _asgi(app, "GET", "/metrics"),
            _asgi(app, "GET", "/health"),
            _asgi(app, "POST", "/tokenize", {"prompt": "abc"}),
            _asgi(app, "POST", "/v1/completions", {"prompt": "abcd", "max_tokens": 1, "add_special_tokens": False}),
            _asgi(app, "POST", "/v1/completions", {"prompt": "x" * 257, "max_tokens": 1}),  # 64 tokens * 2 * 2 chars
        ]
        return [await asyncio.wait_for(call, 10) for call in calls]
    finally:
        gate.set()
        await busy


def test_preparation_and_metrics_never_wait_for_the_engine_thread():
    tokenizer, fake = _Tokenizer(), _Engine()
    engine = AsyncEngine(SimpleNamespace(llm_engine=fake, get_tokenizer=lambda: tokenizer))
    app = build_app(ServerState(engine, ["fake"]))
    engine.start()
    try:
        metrics, health, tokenized, refused, too_long = asyncio.run(_while_engine_busy(app, engine))
    finally:
        engine.stop()
    assert metrics[0] == 200 and 'vllm:prompt_tokens_total{model_name="fake"} 7.0' in metrics[1]
    assert health[0] == 200
    assert tokenized[0] == 200 and json.loads(tokenized[1])["tokens"] == [ord(c) % 50 for c in "abc"]
    assert refused[0] == 400 and "prompt length 4 is refused" in json.loads(refused[1])["error"]["message"]
    assert too_long[0] == 400 and "257 characters are far more than max_model_len=64" in too_long[1]
    assert tokenizer.special == [True, False]  # /tokenize, then the completion; the too long one never tokenized
    assert "pagedllm-engine" not in tokenizer.threads + fake.checked_on
    assert len(fake.checked_on) == 1


def test_documents_reach_the_chat_template():
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.serving_chat import _template_kwargs, render_chat

    template = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[-1]['content'] }}"
    tokenizer, fake = _Tokenizer(), _Engine()
    engine = AsyncEngine(SimpleNamespace(llm_engine=fake, get_tokenizer=lambda: tokenizer))
    state = ServerState(engine, ["fake"], chat_template=template)
    messages = [{"role": "user", "content": "Q?"}]
    req = ChatCompletionRequest(messages=messages, documents=[{"title": "t", "text": "body"}])
    make_prompts = render_chat(state, messages, chat_template_kwargs=_template_kwargs(state, req),
                               add_generation_prompt=False)  # fmt: skip
    assert make_prompts()[0][0] == "[t: body]Q?"


def test_preparation_in_flight_does_not_hold_up_exit():
    """A request still being prepared when the server stops (a huge one, say) must not delay the process's exit."""
    import subprocess
    import sys
    import time

    code = (
        "import time\n"
        "from pagedllm.entrypoints.openai.async_engine import DaemonThreads\n"
        "pool = DaemonThreads(2, 'prep'); pool.start(); pool.submit(time.sleep, 120); time.sleep(0.2)\n"
    )
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert time.monotonic() - start < 30
