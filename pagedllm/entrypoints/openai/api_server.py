"""The FastAPI app of `pagedllm serve`: routes, the API-key, body-size and body-shape guard, OpenAI error bodies.
`python -m pagedllm.entrypoints.openai.api_server [flags]` runs it as `pagedllm serve [flags]` does (launcher.py)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.entrypoints.openai import metrics_text
from pagedllm.entrypoints.openai.async_engine import EngineDeadError
from pagedllm.entrypoints.openai.body_checks import BodyError, check_body
from pagedllm.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    error_body,
    from_value_error,
    now,
)
from pagedllm.entrypoints.openai.serving_chat import create_chat_completion, render_chat
from pagedllm.entrypoints.openai.serving_classify import ClassificationRequest, create_classify
from pagedllm.entrypoints.openai.serving_completions import create_completion
from pagedllm.entrypoints.openai.serving_embeddings import create_embedding
from pagedllm.entrypoints.openai.serving_generate import add_generate_route
from pagedllm.entrypoints.openai.serving_lora import add_lora_routes
from pagedllm.entrypoints.openai.serving_pooling import add_pooling_routes
from pagedllm.entrypoints.openai.serving_profile import add_profile_routes
from pagedllm.entrypoints.openai.serving_responses import add_responses_routes
from pagedllm.entrypoints.openai.serving_sagemaker import add_sagemaker_routes
from pagedllm.entrypoints.openai.serving_utils import ClientGone, ServerState, bad

logger = logging.getLogger(__name__)

PUBLIC_PATHS = ("/health", "/ping", "/metrics")  # reachable without the API key (load balancers, Prometheus)
_DRAIN_FACTOR = 4  # an oversized body is read (and dropped) up to this many times the cap before the 400
_INLINE_CHECK_BYTES = 1 << 16  # larger bodies are checked in a worker thread, not on the event loop


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class LoadMiddleware:
    """--enable-server-load-tracking: counts the POST requests in flight (a stream until its last chunk), which
    GET /load reports as {"server_load": N} (vLLM's, for load balancers)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


class RequestIdMiddleware:
    """--enable-request-id-headers: every response carries X-Request-Id, the request's own or a new one; the
    request's own also names a completion's response (`cmpl-<it>`, `chatcmpl-<it>`: see response_id)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", []) if k == b"x-request-id"), None)
        request_id = given or uuid.uuid4().hex.encode()
        if given:
            scope.setdefault("state", {})["request_id_header"] = given.decode("latin-1")

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class GuardMiddleware:
    """Checks the API key (constant-time) on every path but PUBLIC_PATHS, and refuses bodies over the cap, nested
    too deep or holding lone surrogates before the app parses them (the body is read here, then handed on)."""

    def __init__(self, app, api_key: str | list[str] | None, max_body_bytes: int) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        # any one of several keys (vLLM's --api-key K1 K2, for key rotation); None: no key required
        self.expected = [f"Bearer {k}".encode() for k in keys if k] or None
        self.max_body_bytes = max_body_bytes

    def _authorized(self, scope) -> bool:
        given = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        return any([hmac.compare_digest(given, key) for key in self.expected])  # every key compared: constant time

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, root = scope["path"], scope.get("root_path", "")
        path = path[len(root) :] if root and path.startswith(root) else path  # uvicorn puts --root-path in front
        if self.expected is not None and path not in PUBLIC_PATHS and not self._authorized(scope):
            body = error_body("Invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
            return await _send_json(send, 401, body)
        if scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return await self.app(scope, receive, send)
        body = bytearray()
        size, more = 0, True
        while more and size <= _DRAIN_FACTOR * self.max_body_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_body_bytes:
                body += chunk
            more = message.get("more_body", False)
        if size > self.max_body_bytes:  # read on (a while) and drop, so the client gets the answer, not a reset
            too_big = error_body(f"the request body is larger than {self.max_body_bytes} bytes (--max-body-bytes)")
            return await _send_json(send, 400, too_big)
        try:
            if len(body) > _INLINE_CHECK_BYTES:
                await asyncio.to_thread(check_body, bytes(body))
            else:
                check_body(bytes(body))
        except BodyError as e:
            return await _send_json(send, 400, error_body(str(e), param=e.param))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
    if first.get("type") == "extra_forbidden":
        message = f"{param}: unknown field; this server does not support it (see the README's server section)"
    if first.get("type") == "json_invalid":
        message, param = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    return JSONResponse(error_body(message, param=param), status_code=400)


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # exc.headers carries the Allow header of a 405 (RFC 9110 requires it)
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client went away and its request was aborted

    @app.exception_handler(EngineDeadError)
    async def engine_error(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "server_error"), status_code=500)

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)


def build_app(
    state: ServerState,
    api_key: str | list[str] | None = None,
    cors: dict | None = None,
    openapi: bool = True,
    request_id_headers: bool = False,
    track_load: bool = False,
) -> FastAPI:
    """The app; `cors` (CORSMiddleware's keywords) answers CORS preflights before the API-key check; openapi:
    serve /openapi.json; request_id_headers: X-Request-Id on every response; track_load: GET /load."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        state.engine.stop()

    from pagedllm import __version__

    schema = "/openapi.json" if openapi else None
    app = FastAPI(
        title="pagedllm", version=__version__, docs_url=None, redoc_url=None, openapi_url=schema, lifespan=lifespan
    )
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=state.limits.max_body_bytes)
    if request_id_headers:  # outside the guard: its refusals carry the id too
        app.add_middleware(RequestIdMiddleware)
    if track_load:
        state.server_load = 0
        app.add_middleware(LoadMiddleware, state=state)

        @app.get("/load")
        async def load() -> dict:
            return {"server_load": state.server_load}

    if cors is not None:  # added last: the outermost layer
        app.add_middleware(CORSMiddleware, **cors)
    _add_error_handlers(app)
    _add_routes(app, state, __version__)
    add_responses_routes(app, state)  # /v1/responses, GET and DELETE /v1/responses/{id}
    add_pooling_routes(app, state)  # /v1/score, /v1/rerank, /pooling
    add_sagemaker_routes(app, state)  # /ping, /invocations
    add_generate_route(app, state)  # the demo server's /generate
    add_profile_routes(app, state)  # /start_profile, /stop_profile with VLLM_TORCH_PROFILER_DIR
    return app


def _add_routes(app: FastAPI, state: ServerState, version: str) -> None:
    @app.get("/health", response_class=Response)  # an empty body: the status says it all
    async def health() -> Response:
        return Response(status_code=200 if state.engine.alive else 503)

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": version}

    def card(name: str) -> dict:  # root: the model as the server was given it (vLLM's card)
        return {
            "id": name,
            "object": "model",
            "created": now(),
            "owned_by": "pagedllm",
            "root": state.llm.llm_engine.config.model.model,
            "parent": None,
            "max_model_len": state.max_model_len,
        }

    def lora_card(name: str) -> dict:  # an adapter, as vLLM lists it: its folder as root, the base as parent
        return {**card(name), "root": state.lora_modules[name].lora_path, "parent": state.served_model_names[0]}

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [card(name) for name in state.served_model_names] + [lora_card(n) for n in state.lora_modules]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}")  # :path, as ids may hold slashes ("org/name")
    async def model(model_id: str) -> dict:
        name = state.check_model(model_id)
        return lora_card(name) if name in state.lora_modules else card(name)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(state, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(state, req, raw)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest):
        return await create_embedding(state, req)

    @app.post("/classify")
    async def classify(req: ClassificationRequest):
        return await create_classify(state, req)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        return await _tokenize(state, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        return await _detokenize(state, req)

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus text, as the schema now says
    async def metrics() -> PlainTextResponse:
        # read here, not on the engine thread, so a scrape never waits for a step: the metrics are counters and
        # list lengths, each read whole (a scrape may mix two steps' values, as any live exposition does)
        found = getattr(state.engine.engine, "get_metrics", list)()
        for metric in found:
            if "model_name" in metric.labels:
                metric.labels["model_name"] = state.served_model_names[0]
        found += metrics_text.renamed(found, state.metrics_prefixes)
        return PlainTextResponse(metrics_text.render(found), media_type=metrics_text.CONTENT_TYPE)

    add_lora_routes(app, state)  # only where runtime LoRA updating is allowed


async def _detokenize(state: ServerState, req: DetokenizeRequest) -> dict:
    state.check_model(req.model)
    vocab = state.engine.engine.config.model.vocab_size
    bad_id = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad_id is not None:
        raise bad(f"tokens contains {bad_id}: token ids must be integers in [0, {vocab})", "tokens")
    text = await state.engine.prepare(state.llm.get_tokenizer().decode, req.tokens)
    return {"prompt": text}


async def _tokenize(state: ServerState, req: TokenizeRequest) -> dict:
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad("give either prompt or messages", "prompt")
    tokenizer = state.llm.get_tokenizer()
    if req.prompt is not None:
        prompt = req.prompt

        def encode() -> list[int]:
            return tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)
    else:
        make_prompts = render_chat(
            state,
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs,
        )

        def encode() -> list[int]:
            return make_prompts()[0][1]

    try:
        ids = await state.engine.prepare(encode)
    except (ValueError, TypeError) as e:
        raise from_value_error(e) from None
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


if __name__ == "__main__":  # the same flags as `pagedllm serve`
    from pagedllm.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
