"""POST /generate: the body and answer of vLLM's demo API server (`vllm.entrypoints.api_server`).

The body is {"prompt": str, "stream": bool, ...SamplingParams fields}; the answer {"text": [prompt + output, ...]}
(one per output, n of them), or with stream=true the same object after each step, each followed by a NUL byte."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import fields

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.entrypoints.openai.async_engine import EngineDeadError, RequestStream
from pagedllm.entrypoints.openai.protocol import APIError, error_body, from_value_error, random_id
from pagedllm.entrypoints.openai.serving_utils import (
    ServerState,
    bad,
    check_limit,
    context_check,
    unless_disconnected,
)
from pagedllm.sampling_params import SamplingParams

# SamplingParams fields a JSON body cannot carry here: callables, filled-in fields, and those that need another path
_NOT_IN_BODY = {
    "logits_processors",
    "bad_words_token_ids",
    "structured_outputs",
    "guided_decoding",
    "use_beam_search",
    "length_penalty",
    "early_stopping",
    "logit_bias",
    "output_kind",  # the stream is the server's: cumulative outputs, whatever a body would ask
}
BODY_FIELDS = sorted({f.name for f in fields(SamplingParams)} - _NOT_IN_BODY)


async def _body(raw: Request) -> dict:
    try:
        body = json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _params(state: ServerState, body: dict) -> SamplingParams:
    unknown = sorted(set(body) - set(BODY_FIELDS))
    if unknown:
        raise bad(f"{unknown[0]}: unknown field; /generate takes prompt, stream and {BODY_FIELDS}", unknown[0])
    limits = state.limits
    check_limit(body.get("n"), limits.max_n, "n")
    check_limit(body.get("best_of"), limits.max_n, "best_of")
    check_limit(body.get("logprobs"), limits.max_logprobs, "logprobs")
    check_limit(body.get("prompt_logprobs"), limits.max_logprobs, "prompt_logprobs")
    try:
        return SamplingParams(**body)
    except (ValueError, TypeError) as e:
        raise from_value_error(e) from None


async def create_generate(state: ServerState, raw: Request):
    state.require_generate()
    body = await _body(raw)
    prompt = body.pop("prompt", None)
    stream_wanted = body.pop("stream", False)
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt must be a non-empty string", "prompt")
    if not isinstance(stream_wanted, bool):
        raise bad(f"stream={stream_wanted!r} must be true or false", "stream")
    params = _params(state, body)
    tokenizer = state.llm.get_tokenizer()

    def make_prompts() -> list[tuple[str | None, list[int]]]:
        state.check_prompt_chars(len(prompt), "prompt")
        return [(prompt, tokenizer.encode(prompt))]

    check = context_check(state.max_model_len, params.max_tokens, params.truncate_prompt_tokens)
    try:
        stream = await state.engine.generate(make_prompts, 1, params, random_id("generate"), check=check)
    except (ValueError, TypeError) as e:
        raise from_value_error(e, "prompt") from None
    if stream_wanted:
        return StreamingResponse(_chunks(prompt, stream), media_type="application/json")
    return JSONResponse({"text": await unless_disconnected(raw, _final(prompt, stream))})


def _texts(prompt: str, out) -> list[str]:
    return [prompt + c.text for c in out.outputs]


async def _final(prompt: str, stream: RequestStream) -> list[str]:
    texts: list[str] = []
    async with stream:
        async for _, out in stream:
            texts = _texts(prompt, out)
    return texts


async def _chunks(prompt: str, stream: RequestStream) -> AsyncIterator[bytes]:
    try:
        async with stream:
            async for _, out in stream:
                yield (json.dumps({"text": _texts(prompt, out)}) + "\0").encode()
    except APIError as e:
        yield (json.dumps(e.body()) + "\0").encode()
    except EngineDeadError as e:
        yield (json.dumps(error_body(str(e), "server_error")) + "\0").encode()


def add_generate_route(app: FastAPI, state: ServerState) -> None:
    async def generate(raw: Request):
        return await create_generate(state, raw)

    app.add_api_route("/generate", generate, methods=["POST"])
