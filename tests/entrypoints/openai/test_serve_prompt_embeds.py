"""/v1/completions' prompt_embeds (base64 of torch.save'd tensors), in process over a tiny random Llama: the tokens
of the token prompt they came from, before the token prompts in the choices, usage counting their positions, and
the 400s (flag off, bad base64, wrong shape, echo, beam search)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import pytest
import torch
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

pytest.importorskip("fastapi")

from pagedllm import LLM  # noqa: E402
from pagedllm.entrypoints.openai.api_server import build_app  # noqa: E402
from pagedllm.entrypoints.openai.async_engine import AsyncEngine  # noqa: E402
from pagedllm.entrypoints.openai.serving_utils import ServerState  # noqa: E402

IDS = [(5 * i) % 250 + 1 for i in range(21)]


async def _post(app, body: dict) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST"}
    scope.update(path="/v1/completions", raw_path=b"/v1/completions", query_string=b"", headers=headers,
                 scheme="http", server=("t", 80))  # fmt: skip
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
    return status, json.loads(b"".join(chunks))


def _b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_decoder("llama-serve-embeds", transformers.LlamaConfig, transformers.LlamaForCausalLM,
                             TINY_DECODER, tmp_path_factory)  # fmt: skip


def _run(llm: LLM, bodies: list[dict]) -> list[tuple[int, dict]]:
    engine = AsyncEngine(llm)
    app = build_app(ServerState(engine, ["tiny"]))
    engine.start()
    try:
        return [asyncio.run(_post(app, {"model": "tiny", **body})) for body in bodies]
    finally:
        engine.stop()


def _bad_sparse() -> torch.Tensor:
    indices = torch.tensor([[0, 100000], [0, 1]])
    return torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0]), (4, 64), check_invariants=False)


def test_completions_take_base64_prompt_embeds(tiny):
    hf, path = tiny
    llm = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              enable_prompt_embeds=True, kv_cache_memory_bytes=1 << 22)  # fmt: skip
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor(IDS))
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    bodies = [
        {"prompt": IDS[:5], "prompt_embeds": [_b64(embeds), _b64(embeds[None].to(torch.bfloat16))], **greedy},
        {"prompt": IDS, **greedy},
        {"prompt_embeds": _b64(embeds.to_sparse()), **greedy},
        {"prompt_embeds": "not base64!", **greedy},
        {"prompt_embeds": _b64(embeds[:, :7]), **greedy},
        {"prompt_embeds": _b64(embeds), "echo": True, **greedy},
        {"prompt_embeds": _b64(embeds), "use_beam_search": True, "n": 2, **greedy},
        {**greedy},
        {"prompt_embeds": _b64(_bad_sparse()), **greedy},  # an index past its shape: to_dense would write out of it
        {
            "prompt_embeds": _b64(
                torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long), [1.0], (1 << 20, 1 << 10))
            ),
            **greedy,
        },  # a dense size of 2**30 elements: refused before it is allocated
    ]
    (ok, mixed), (_, tokens), (sparse_ok, sparse), *refused = _run(llm, bodies)
    assert ok == 200 and len(mixed["choices"]) == 3

    def ids_of(body, i=0):
        return body["choices"][i]["logprobs"]["tokens"]  # "token_id:N"

    # the prompts of embeddings first (as vLLM's); their tokens are the token prompt's (float32)
    assert len(ids_of(tokens)) == 6 and ids_of(mixed) == ids_of(tokens)
    assert ids_of(mixed, 2) == ids_of(_run(llm, [{"prompt": IDS[:5], **greedy}])[0][1])
    assert mixed["usage"]["prompt_tokens"] == 21 + 21 + 5
    assert sparse_ok == 200 and ids_of(sparse) == ids_of(tokens)
    messages = [(status, body["error"]["message"]) for status, body in refused]
    assert messages[0][0] == 400 and "prompt_embeds[0]: not a base64-encoded torch.save" in messages[0][1]
    assert messages[1][0] == 400 and "expected [seq_len, 64]" in messages[1][1]
    assert messages[2][0] == 400 and "echo: a prompt of embeddings" in messages[2][1]
    assert messages[3][0] == 400 and "beam search takes text or token prompts" in messages[3][1]
    assert messages[4][0] == 400 and "give prompt or prompt_embeds" in messages[4][1]
    assert messages[5][0] == 400 and "prompt_embeds[0]: not a base64-encoded torch.save" in messages[5][1]
    assert messages[6][0] == 400 and "a sparse tensor of shape [1048576, 1024]: at most" in messages[6][1]
    off = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              kv_cache_memory_bytes=1 << 22)  # fmt: skip
    [(status, body)] = _run(off, [{"prompt_embeds": _b64(embeds), **greedy}])
    assert status == 400 and "--enable-prompt-embeds" in body["error"]["message"]
