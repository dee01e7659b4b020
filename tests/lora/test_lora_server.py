"""The server with --lora-modules (in process, through the ASGI app): /v1/models lists each adapter with its parent,
model=NAME selects the adapter and answers what the offline LLM answers with it; bad modules stop the start;
/v1/load_lora_adapter and /v1/unload_lora_adapter exist only where runtime updating is allowed."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from char_tokenizer import char_tokenizer  # noqa: E402

from pagedllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedllm.entrypoints.openai.async_engine import AsyncEngine  # noqa: E402
from pagedllm.entrypoints.openai.launcher import lora_modules  # noqa: E402
from pagedllm.entrypoints.openai.serving_utils import ServerState  # noqa: E402

PROMPT = "hello"


async def _asgi(app, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
    """One HTTP exchange with the ASGI app: (status, JSON body or text)."""
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
        await asyncio.Event().wait()

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        else:
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    text = b"".join(chunks).decode()
    try:
        return status, json.loads(text or "null")
    except json.JSONDecodeError:
        return status, text


def completion_ids(answer: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]


def test_lora_modules_are_served_as_models(lora_family, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    _, base_path, _, adapters = lora_family
    tok_dir = tmp_path / "tok"
    char_tokenizer().save_pretrained(tok_dir)
    llm = LLM(
        base_path, tokenizer=str(tok_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22,
        enable_lora=True, max_loras=2, max_lora_rank=16,
    )  # fmt: skip
    specs = [f"a1={adapters['all'][0]}", json.dumps({"name": "a2", "path": adapters["mlp-r16"][0]})]
    loras = lora_modules(llm, specs, ["base"])
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    offline = {
        name: llm.generate(PROMPT, sp, use_tqdm=False, lora_request=loras.get(name))[0].outputs[0].token_ids
        for name in ("base", "a1", "a2")
    }
    assert offline["a1"] != offline["base"]
    engine = AsyncEngine(llm)
    app = build_app(ServerState(engine, ["base"], lora_modules=loras))
    engine.start()

    async def exchanges():
        body = dict(prompt=PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
        body["return_tokens_as_token_ids"] = True
        calls = [_asgi(app, "GET", "/v1/models"), _asgi(app, "GET", "/v1/models/a2")]
        calls += [_asgi(app, "POST", "/v1/completions", {**body, "model": name}) for name in ("base", "a1", "a2", "x")]
        return [await call for call in calls]

    try:
        models, one, *answers, unknown = asyncio.run(exchanges())
    finally:
        engine.stop()
    assert models[0] == 200
    cards = {card["id"]: card for card in models[1]["data"]}
    assert list(cards) == ["base", "a1", "a2"]
    assert (cards["a1"]["parent"], cards["a1"]["root"], cards["a2"]["parent"]) == ("base", adapters["all"][0], "base")
    assert cards["base"].get("parent") is None  # the base model has none (vLLM's card says null)
    assert one == (200, cards["a2"] | {"created": one[1]["created"]})
    for name, (status, answer) in zip(("base", "a1", "a2"), answers):
        assert status == 200, answer
        assert answer["model"] == name
        assert completion_ids(answer) == offline[name], name
    assert unknown[0] == 404
    engine = AsyncEngine(llm)
    app = build_app(ServerState(engine, ["base"], lora_modules=loras))
    engine.start()
    try:
        no_route = asyncio.run(_asgi(app, "POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}))
    finally:
        engine.stop()
    assert no_route[0] == 404, "runtime loading is off unless allowed"


def test_runtime_load_and_unload(lora_family, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    _, base_path, _, adapters = lora_family
    tok_dir = tmp_path / "tok"
    char_tokenizer().save_pretrained(tok_dir)
    llm = LLM(
        base_path, tokenizer=str(tok_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22,
        enable_lora=True, max_loras=1, max_lora_rank=8,
    )  # fmt: skip
    path = adapters["qv-rslora"][0]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    offline = llm.generate(PROMPT, sp, use_tqdm=False, lora_request=LoRARequest("q", 7, path))[0].outputs[0].token_ids
    engine = AsyncEngine(llm)
    app = build_app(ServerState(engine, ["base"]))
    engine.start()
    body = dict(prompt=PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
    body["return_tokens_as_token_ids"] = True

    async def exchanges():
        return [
            await _asgi(app, "POST", "/v1/load_lora_adapter", {"lora_name": "q", "lora_path": path}),
            await _asgi(app, "POST", "/v1/load_lora_adapter", {"lora_name": "q", "lora_path": path}),
            await _asgi(app, "POST", "/v1/load_lora_adapter", {"lora_name": "m", "lora_path": str(tmp_path / "no")}),
            await _asgi(
                app, "POST", "/v1/load_lora_adapter", {"lora_name": "r16", "lora_path": adapters["mlp-r16"][0]}
            ),
            await _asgi(app, "POST", "/v1/completions", {**body, "model": "q"}),
            await _asgi(app, "GET", "/v1/models"),
            await _asgi(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "q"}),
            await _asgi(app, "POST", "/v1/unload_lora_adapter", {"lora_name": "q"}),
            await _asgi(app, "POST", "/v1/completions", {**body, "model": "q"}),
        ]

    try:
        loaded, again, missing, too_big, answer, models, unloaded, unknown, gone = asyncio.run(exchanges())
    finally:
        engine.stop()
    assert loaded == (200, "Success: LoRA adapter 'q' added successfully.")
    assert again[0] == 400 and "already served" in again[1]["error"]["message"]
    assert missing[0] == 400 and "no such folder" in missing[1]["error"]["message"]
    assert too_big[0] == 400 and "max_lora_rank=8" in too_big[1]["error"]["message"]
    assert answer[0] == 200 and completion_ids(answer[1]) == offline
    assert [m["id"] for m in models[1]["data"]] == ["base", "q"]
    assert unloaded == (200, "Success: LoRA adapter 'q' removed successfully.")
    assert unknown[0] == 404 and gone[0] == 404


def test_bad_lora_modules_stop_the_start(lora_family, tmp_path):
    _, base_path, _, adapters = lora_family
    plain = LLM(base_path, device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 21)
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        lora_modules(plain, [f"a={adapters['all'][0]}"], ["base"])
    llm = LLM(base_path, device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 21, enable_lora=True)
    with pytest.raises(ValueError, match="no such folder"):
        lora_modules(llm, [f"a={tmp_path / 'nope'}"], ["base"])
    with pytest.raises(ValueError, match="give name=path"):
        lora_modules(llm, ["just-a-name"], ["base"])
    with pytest.raises(ValueError, match="'base' is already served"):
        lora_modules(llm, [f"base={adapters['all'][0]}"], ["base"])
