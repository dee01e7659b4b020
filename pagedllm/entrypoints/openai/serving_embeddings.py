"""POST /v1/embeddings on a server started with `--task embed`: the inputs go through `LLM.embed` (the same
pooling path as offline), and come back as floats or as base64 of little-endian float32 (what the openai client
asks for by default)."""

from __future__ import annotations

import base64

import numpy as np
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.protocol import EmbeddingRequest, from_value_error, now, random_id
from pagedllm.entrypoints.openai.serving_utils import ServerState, bad, check_limit
from pagedllm.pooling_params import PoolingParams


def _inputs(raw) -> list:
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]
    if not raw or any(not item for item in raw):
        raise bad("input is empty: give at least one text or token list, none of them empty", "input")
    return [item if isinstance(item, str) else {"prompt_token_ids": list(item)} for item in raw]


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


async def create_embedding(state: ServerState, req: EmbeddingRequest) -> JSONResponse:
    model = state.check_model(req.model)
    if state.engine.generates:
        raise bad("this server runs a generative model: start `pagedllm serve` with --task embed for embeddings")
    prompts = _inputs(req.input)
    check_limit(len(prompts), state.limits.max_prompts, "input")
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
