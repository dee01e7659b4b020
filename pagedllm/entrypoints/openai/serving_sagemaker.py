"""The routes a SageMaker container answers (vLLM's): GET/POST /ping (the health check, as /health) and POST
/invocations, one route for every task: the body's shape picks the endpoint that serves it, among those of the
served model's kind, and the body is then read and answered exactly as that endpoint reads and answers it.

Generative model: `messages` -> /v1/chat/completions, `prompt` -> /v1/completions. Pooling model: `query` with
`documents` -> /v1/rerank; `text_1`, `data_1` or `queries` -> /v1/score; `input` or `messages` -> /v1/embeddings
(an embedding model), /classify (a classification model) or /pooling (any other)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from pagedllm.entrypoints.openai.serving_chat import create_chat_completion
from pagedllm.entrypoints.openai.serving_classify import ClassificationRequest, create_classify
from pagedllm.entrypoints.openai.serving_completions import create_completion
from pagedllm.entrypoints.openai.serving_embeddings import create_embedding
from pagedllm.entrypoints.openai.serving_generate import _body
from pagedllm.entrypoints.openai.serving_pooling import (
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    create_pooling,
    create_rerank,
    create_score,
)
from pagedllm.entrypoints.openai.serving_utils import ServerState, bad

Handler = Callable[..., Awaitable[Any]]


def _generative_target(body: dict) -> tuple[type[BaseModel], Handler, bool]:
    if "messages" in body:
        return ChatCompletionRequest, create_chat_completion, True
    if "prompt" in body:
        return CompletionRequest, create_completion, True
    raise bad("/invocations: give messages (chat completions) or prompt (completions)", "messages")


def _pooling_target(state: ServerState, body: dict) -> tuple[type[BaseModel], Handler, bool]:
    if "query" in body and "documents" in body:
        return RerankRequest, create_rerank, False
    if any(name in body for name in ("text_1", "data_1", "queries")):
        return ScoreRequest, create_score, False
    if "input" in body or "messages" in body:
        task = state.engine.engine.spec.default_task
        if task == "embed":
            return EmbeddingRequest, create_embedding, False
        if task == "classify":
            return ClassificationRequest, create_classify, False
        return PoolingRequest, create_pooling, False
    raise bad(
        "/invocations: give input or messages (embeddings, classification, pooling), text_1 and text_2 (score), "
        "or query and documents (rerank)",
        "input",
    )


async def invocations(state: ServerState, raw: Request):
    body = await _body(raw)
    target = _generative_target if state.engine.generates else lambda b: _pooling_target(state, b)
    request_type, handler, takes_raw = target(body)
    try:
        req = request_type.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None  # the 400 every endpoint gives for a bad body
    return await (handler(state, req, raw) if takes_raw else handler(state, req))


def add_sagemaker_routes(app: FastAPI, state: ServerState) -> None:
    async def ping() -> Response:
        return Response(status_code=200 if state.engine.alive else 503)

    for method in ("GET", "POST"):  # one route each: one operation id each in the OpenAPI schema
        app.add_api_route("/ping", ping, methods=[method], response_class=Response, name=f"ping_{method.lower()}")

    async def invoke(raw: Request):
        return await invocations(state, raw)

    app.add_api_route("/invocations", invoke, methods=["POST"])
