"""vLLM's pooling endpoints on a server started with a pooling model: POST /v1/score (and /score), /v1/rerank (and
/rerank, /v2/rerank) and /pooling, with vLLM's request and response bodies. They run through the offline pooling
path (`LLM.score`, `LLM.encode`): a cross-encoder scores each (query, document) pair itself, an embedding model
gives the cosine of the two embeddings."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import Field

from pagedllm.entrypoints.openai.protocol import (
    ChatInputFields,
    PoolingInput,
    _Request,
    from_value_error,
    now,
    random_id,
)
from pagedllm.entrypoints.openai.serving_embeddings import _encode, pooling_prompts
from pagedllm.entrypoints.openai.serving_utils import ServerState, bad, check_limit
from pagedllm.pooling_params import PoolingParams

TextOrTexts = str | list[str]


class ScoreRequest(_Request):
    """vLLM's score body: text_1 against text_2 (one against many, or pairwise), also as data_1 / data_2 or
    queries / documents (vLLM's later names)."""

    model: str | None = None
    text_1: TextOrTexts | None = None
    text_2: TextOrTexts | None = None
    data_1: TextOrTexts | None = None
    data_2: TextOrTexts | None = None
    queries: TextOrTexts | None = None
    documents: TextOrTexts | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class RerankRequest(_Request):
    """vLLM's rerank body (Jina and Cohere's shape): the documents ranked by relevance to the query."""

    model: str | None = None
    query: str = Field(examples=["What is the capital of France?"])
    documents: list[str]
    top_n: int = 0  # 0: all documents
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class PoolingRequest(ChatInputFields):
    """vLLM's /pooling body: the model's raw pooled output of each input (or of the rendered messages)."""

    model: str | None = None
    input: PoolingInput | None = Field(default=None, examples=["A sentence to pool."])
    encoding_format: Literal["float", "base64"] = "float"
    task: str | None = None  # the model's own task by default; "token_embed" gives one vector per token
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None


def _side(req: ScoreRequest, names: tuple[str, str, str]) -> list[str]:
    given = [(n, getattr(req, n)) for n in names if getattr(req, n) is not None]
    if len(given) != 1:
        what = "none" if not given else " and ".join(n for n, _ in given)
        raise bad(f"give exactly one of {', '.join(names)} (got {what})", names[0])
    name, value = given[0]
    items = [value] if isinstance(value, str) else list(value)
    if not items or any(not t for t in items):
        raise bad(f"{name} is empty: give at least one text, none of them empty", name)
    return items


def _require_pooling(state: ServerState, endpoint: str) -> None:
    if state.engine.generates:
        raise bad(f"{endpoint}: this server runs a generative model; start `pagedllm serve` with a pooling model")


async def _scores(state: ServerState, left: list[str], right: list[str], truncate: int | None, param: str):
    check_limit(len(left) + len(right), state.limits.max_prompts, param)
    if len(left) != 1 and len(left) != len(right):
        raise bad(f"{len(left)} queries and {len(right)} documents: allowed 1 and N, or N and N (pairwise)", param)
    try:
        return await state.engine.call(
            state.llm.score, left, right, truncate_prompt_tokens=truncate, use_tqdm=False
        )  # fmt: skip
    except (ValueError, TypeError) as e:
        raise from_value_error(e, param) from None


def _usage(outputs: list) -> dict:
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}


async def create_score(state: ServerState, req: ScoreRequest) -> JSONResponse:
    model = state.check_model(req.model)
    _require_pooling(state, "/v1/score")
    left = _side(req, ("text_1", "data_1", "queries"))
    right = _side(req, ("text_2", "data_2", "documents"))
    outputs = await _scores(state, left, right, req.truncate_prompt_tokens, "text_1")
    data = [{"index": i, "object": "score", "score": float(o.outputs.score)} for i, o in enumerate(outputs)]
    body = {"id": random_id("score"), "object": "list", "created": now(), "model": model, "data": data}
    return JSONResponse({**body, "usage": _usage(outputs)})


async def create_rerank(state: ServerState, req: RerankRequest) -> JSONResponse:
    model = state.check_model(req.model)
    _require_pooling(state, "/v1/rerank")
    if not req.query:
        raise bad("query is empty", "query")
    if not req.documents or any(not d for d in req.documents):
        raise bad("documents is empty: give at least one document, none of them empty", "documents")
    if req.top_n < 0:
        raise bad(f"top_n={req.top_n} is out of range: 0 (all documents) or more", "top_n")
    outputs = await _scores(state, [req.query], req.documents, req.truncate_prompt_tokens, "documents")
    order = sorted(range(len(outputs)), key=lambda i: -float(outputs[i].outputs.score))
    results = []
    for i in order[: req.top_n or len(order)]:
        result: dict[str, Any] = {"index": i, "relevance_score": float(outputs[i].outputs.score)}
        if req.return_documents:
            result["document"] = {"text": req.documents[i]}
        results.append(result)
    num_tokens = _usage(outputs)["total_tokens"]
    body = {"id": random_id("rerank"), "model": model, "usage": {"total_tokens": num_tokens}}
    return JSONResponse({**body, "results": results})


def _nested(data, encoding_format: str):
    """A pooled tensor as JSON: floats (nested for 2-D outputs), or base64 of little-endian float32 (flattened)."""
    if encoding_format == "base64":
        return _encode(data.reshape(-1).tolist(), "base64")
    return data.tolist()


async def create_pooling(state: ServerState, req: PoolingRequest) -> JSONResponse:
    model = state.check_model(req.model)
    _require_pooling(state, "/pooling")
    prompts = await pooling_prompts(state, req)
    try:
        params = PoolingParams(
            dimensions=req.dimensions, normalize=req.normalize, truncate_prompt_tokens=req.truncate_prompt_tokens
        )
        outputs = await state.engine.call(
            state.llm.encode, prompts, pooling_params=params, pooling_task=req.task, use_tqdm=False
        )
    except (ValueError, TypeError) as e:
        raise from_value_error(e, "input") from None
    data = [
        {"index": i, "object": "pooling", "data": _nested(o.outputs.data.float(), req.encoding_format)}
        for i, o in enumerate(outputs)
    ]
    body = {"id": random_id("pool"), "object": "list", "created": now(), "model": model, "data": data}
    return JSONResponse({**body, "usage": _usage(outputs)})


def add_pooling_routes(app: FastAPI, state: ServerState) -> None:
    for path in ("/v1/score", "/score"):
        app.add_api_route(path, _bind(create_score, state, ScoreRequest), methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, _bind(create_rerank, state, RerankRequest), methods=["POST"])
    app.add_api_route("/pooling", _bind(create_pooling, state, PoolingRequest), methods=["POST"])


def _bind(handler, state: ServerState, body_type):
    async def route(req: body_type):  # type: ignore[valid-type]
        return await handler(state, req)

    route.__annotations__ = {"req": body_type}
    return route
