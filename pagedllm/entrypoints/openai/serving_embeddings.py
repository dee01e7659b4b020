"""POST /v1/embeddings on a server started with `--task embed`: the inputs go through `LLM.embed` (the same
pooling path as offline), and come back as floats or as base64 of little-endian float32 (what the openai client
asks for by default).

Instead of `input`, this endpoint, /pooling and /classify take vLLM's `messages`: one conversation, rendered with
the chat template as chat completions render it (without the generation prompt and without the tokenizer's special
tokens unless asked: vLLM's defaults), then pooled as one prompt."""

from __future__ import annotations

import base64

import numpy as np
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.protocol import ChatInputFields, EmbeddingRequest, from_value_error, now, random_id
from pagedllm.entrypoints.openai.serving_chat import render_chat
from pagedllm.entrypoints.openai.serving_utils import ServerState, bad, check_limit
from pagedllm.pooling_params import PoolingParams


def _inputs(raw) -> list:
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]
    if not raw or any(not item for item in raw):
        raise bad("input is empty: give at least one text or token list, none of them empty", "input")
    return [item if isinstance(item, str) else {"prompt_token_ids": list(item)} for item in raw]


_CHAT_ONLY = (("add_generation_prompt", False), ("continue_final_message", False), ("chat_template_kwargs", None))


async def pooling_prompts(state: ServerState, req: ChatInputFields) -> list:
    """The prompts of a pooling body: its `input` items, or its `messages` rendered (one prompt of token ids)."""
    given = req.input is not None, req.messages is not None
    if all(given):
        raise bad("give either input or messages (a chat conversation), not both", "messages")
    if not any(given):
        raise bad("input: Field required (or messages: a chat conversation)", "input")
    if req.chat_template is not None:
        message = "chat_template: a request may not bring its own template; start the server with --chat-template"
        raise bad(message, "chat_template")
    if req.input is not None:
        for name, default in _CHAT_ONLY:
            if getattr(req, name) != default:
                raise bad(f"{name} applies only with messages", name)
        if req.add_special_tokens is False:
            raise bad("add_special_tokens=false is supported only with messages", "add_special_tokens")
        prompts = _inputs(req.input)
        check_limit(len(prompts), state.limits.max_prompts, "input")
        return prompts
    kwargs = {**state.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
    make_prompts = render_chat(
        state,
        req.messages,
        add_special_tokens=bool(req.add_special_tokens),
        check_chars=getattr(req, "truncate_prompt_tokens", None) is None,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=kwargs or None,
    )
    try:
        rendered = await state.engine.prepare(make_prompts)
    except (ValueError, TypeError) as e:
        raise from_value_error(e, "messages") from None
    return [{"prompt_token_ids": list(ids)} for _, ids, *_ in rendered]


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


async def create_embedding(state: ServerState, req: EmbeddingRequest) -> JSONResponse:
    model = state.check_model(req.model)
    if state.engine.generates:
        raise bad("this server runs a generative model: start `pagedllm serve` with --task embed for embeddings")
    prompts = await pooling_prompts(state, req)
    try:
        params = PoolingParams(
            dimensions=req.dimensions, normalize=req.normalize, truncate_prompt_tokens=req.truncate_prompt_tokens
        )
        lora = state.lora_request(req.model)
        outputs = await state.engine.call(
            state.llm.embed, prompts, pooling_params=params, use_tqdm=False, lora_request=lora
        )
    except (ValueError, TypeError) as e:
        raise from_value_error(e, "input") from None
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(o.outputs.embedding, req.encoding_format)}
        for i, o in enumerate(outputs)
    ]
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    body = {"id": random_id("embd"), "object": "list", "created": now(), "model": model, "data": data}
    return JSONResponse({**body, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
