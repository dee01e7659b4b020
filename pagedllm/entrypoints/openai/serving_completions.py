"""POST /v1/completions: prompts as text, token ids or lists of either; OpenAI's legacy response and SSE chunks.

Logprobs come in the legacy layout (tokens, token_logprobs, top_logprobs, text_offset). `echo` puts the prompt in
front of each choice's text and, with logprobs, the prompt tokens' logprobs in front of the generated ones (the
first prompt token has none): with `max_tokens=0` that is exactly what lm-eval's loglikelihood requests read."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.entrypoints.openai.async_engine import RequestStream
from pagedllm.entrypoints.openai.protocol import CompletionRequest, from_value_error, now
from pagedllm.entrypoints.openai.serving_beam import beam_search, refuse_with_beam_search
from pagedllm.entrypoints.openai.serving_embeds import decode_prompt_embeds, embeds_pairs
from pagedllm.entrypoints.openai.serving_structured import grammar_check, structured_outputs
from pagedllm.entrypoints.openai.serving_utils import (
    ServerState,
    bad,
    check_limit,
    context_check,
    legacy_logprobs,
    prompt_logprobs_json,
    response_id,
    sampling_params,
    sse_stream,
    unless_disconnected,
    usage,
)
from pagedllm.outputs import CompletionOutput, RequestOutput


@dataclass
class _Job:
    req: CompletionRequest
    model: str
    request_id: str
    created: int
    tokenizer: object
    echo_only: bool  # echo with max_tokens=0: the prompt alone (one token is generated and dropped)
    embeds_lens: dict | None = None  # request id -> prompt length of a prompt of embeddings (no prompt ids)

    def chunk(self, choices: list[dict], finals: dict | None = None) -> dict:
        """A stream chunk; with continuous_usage_stats, the usage so far of the outputs in `finals`."""
        out = {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model}
        out["choices"] = choices
        options = self.req.stream_options
        if options and options.include_usage:
            out["usage"] = _usage(self, list(finals.values())) if options.continuous_usage_stats else None
        return out

    def logprobs(self, token_ids: list[int], entries: list, text_offset: int = 0) -> dict:
        as_ids = bool(self.req.return_tokens_as_token_ids)
        return legacy_logprobs(self.tokenizer, token_ids, entries, text_offset, as_ids)


def _prompt_items(prompt) -> list:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def _tokenize(state: ServerState, tokenizer, items: list, req: CompletionRequest):
    add_special_tokens = req.add_special_tokens

    def make_prompts() -> list[tuple[str | None, list[int]]]:
        if tokenizer is None and any(isinstance(p, str) for p in items):
            raise ValueError("prompt: text prompts need a tokenizer; send token ids")
        if req.truncate_prompt_tokens is None:  # else the prompt's last tokens are wanted, however long it is
            for p in items:
                if isinstance(p, str):
                    state.check_prompt_chars(len(p), "prompt")
        return [
            (p, tokenizer.encode(p, add_special_tokens=add_special_tokens)) if isinstance(p, str) else (None, list(p))
            for p in items
        ]

    return make_prompts


def _check(state: ServerState, req: CompletionRequest, num_embeds: int) -> list:
    """The request's text / token prompts, after the checks that need no tokenizer."""
    if req.suffix:
        raise bad("suffix is not supported", "suffix")
    if req.stream and req.prompt_logprobs is not None:
        raise bad("prompt_logprobs are not available when stream=true (as vLLM)", "prompt_logprobs")
    if req.prompt is None and not num_embeds:
        raise bad("prompt: give prompt or prompt_embeds", "prompt")
    items = _prompt_items(req.prompt) if req.prompt is not None else []
    if (not items and not num_embeds) or any(not p for p in items):
        raise bad("prompt is empty: give at least one prompt, each with at least one token", "prompt")
    check_limit(len(items), state.limits.max_prompts, "prompt")
    check_limit(req.logprobs, state.limits.max_logprobs, "logprobs")
    check_limit(req.prompt_logprobs, state.limits.max_logprobs, "prompt_logprobs")
    return items


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    model = state.check_model(req.model)
    state.require_generate()
    engine_config = state.engine.engine.config
    embeds = []  # prompts of embeddings (serving_embeds.py)
    if req.prompt_embeds is not None:
        embeds = decode_prompt_embeds(req.prompt_embeds, engine_config.model.enable_prompt_embeds)
    items = _check(state, req, len(embeds))
    if embeds and req.echo:
        raise bad("echo: a prompt of embeddings has no text or tokens to echo", "echo")
    state.apply_defaults(req)
    echo_only = bool(req.echo) and req.max_tokens == 0
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    max_tokens = 1 if echo_only else req.max_tokens
    params = sampling_params(state, req, max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
    if req.stream and params.best_of is not None and params.best_of != params.n:
        raise bad("best_of must equal n when streaming (the best sequences are known only at the end)", "best_of")
    job = _Job(req, model, response_id("cmpl", req, raw), now(), state.llm.get_tokenizer(), echo_only)
    make_prompts = _tokenize(state, job.tokenizer, items, req)
    if embeds:  # first, as vLLM's
        make_prompts = _with_embeds(job, embeds, engine_config, make_prompts)
    check = context_check(state.max_model_len, req.max_tokens, req.truncate_prompt_tokens)
    check = grammar_check(state.engine.engine, params, structured_outputs(req)[1], check)
    if params.use_beam_search:
        if embeds:
            raise bad("prompt_embeds: beam search takes text or token prompts", "prompt_embeds")
        refuse_with_beam_search(bool(req.stream), req.logprobs is not None, req.prompt_logprobs is not None)
        lora = state.lora_request(req.model)
        work = beam_search(state.engine, make_prompts, params, job.request_id, check, req.cache_salt, lora)
        try:
            return JSONResponse(_response(job, await unless_disconnected(raw, work)))
        except (ValueError, TypeError) as e:
            raise from_value_error(e, "prompt") from None
    try:
        stream = await state.engine.generate(
            make_prompts,
            len(embeds) + len(items),
            params,
            job.request_id,
            check=check,
            cache_salt=req.cache_salt,
            lora_request=state.lora_request(req.model),
        )
    except (ValueError, TypeError) as e:
        raise from_value_error(e, "prompt") from None
    if req.stream:
        return StreamingResponse(sse_stream(_chunks(job, stream)), media_type="text/event-stream")
    finals = await unless_disconnected(raw, _collect(stream))
    return JSONResponse(_response(job, finals))


async def _collect(stream: RequestStream) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async with stream:
        async for index, out in stream:
            finals[index] = out
    return [finals[i] for i in sorted(finals)]


def _echo_prefix(job: _Job, out: RequestOutput) -> tuple[str, list[int], list]:
    """(text, token ids, logprob entries) that echo puts in front of a choice."""
    if not job.req.echo:
        return "", [], []
    text = out.prompt if out.prompt is not None else job.tokenizer.decode(out.prompt_token_ids)
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return text, list(out.prompt_token_ids), list(entries)


def _generated(job: _Job, c: CompletionOutput) -> tuple[str, list[int], list]:
    if job.echo_only:
        return "", [], []
    return c.text, list(c.token_ids), list(c.logprobs or [])


def _finish_reason(job: _Job, c: CompletionOutput) -> str | None:
    return "length" if job.echo_only and c.finish_reason is not None else c.finish_reason


def _response(job: _Job, finals: list[RequestOutput]) -> dict:
    req, choices, num_generated = job.req, [], 0
    for p, out in enumerate(finals):
        prefix_text, prefix_ids, prefix_entries = _echo_prefix(job, out)
        for c in out.outputs:
            text, token_ids, entries = _generated(job, c)
            num_generated += len(token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = job.logprobs(prefix_ids + token_ids, prefix_entries + entries)
            choice = {
                "index": p * req.n + c.index,
                "text": prefix_text + text,
                "logprobs": logprobs,
                "finish_reason": _finish_reason(job, c),
                "stop_reason": c.stop_reason,
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            choices.append(choice)
    body = {"id": job.request_id, "object": "text_completion", "created": job.created, "model": job.model}
    return {**body, "choices": choices, "usage": _usage(job, finals)}


def _with_embeds(job: _Job, embeds: list, config, make_prompts):
    """make_prompts with the prompts of embeddings in front (checked in the preparation thread too)."""

    def make() -> list:
        model, truncate = config.model, job.req.truncate_prompt_tokens
        pairs = embeds_pairs(embeds, model.hf_config.hidden_size, truncate, model.max_model_len)
        job.embeds_lens = {f"{job.request_id}-{i}": len(ids) for i, (_, ids) in enumerate(pairs)}
        return pairs + make_prompts()

    return make


def _usage(job: _Job, finals: list[RequestOutput]) -> dict:
    lens = job.embeds_lens or {}
    num_prompt = sum(len(out.prompt_token_ids or ()) or lens.get(out.request_id, 0) for out in finals)
    num_generated = sum(len(_generated(job, c)[1]) for out in finals for c in out.outputs)
    return usage(num_prompt, num_generated, sum(out.num_cached_tokens for out in finals))


class _Progress:
    """What one streamed choice has sent so far."""

    def __init__(self) -> None:
        self.chars = 0  # of generated text
        self.tokens = 0  # generated tokens
        self.offset = 0  # characters sent, echoed prompt included (logprobs' text_offset)
        self.started = False
        self.done = False


def _delta(job: _Job, out: RequestOutput, c: CompletionOutput, progress: _Progress) -> dict | None:
    text, token_ids, entries = _generated(job, c)
    new_text, new_ids, new_entries = text[progress.chars :], token_ids[progress.tokens :], entries[progress.tokens :]
    if not progress.started:
        prefix_text, prefix_ids, prefix_entries = _echo_prefix(job, out)
        new_text, new_ids, new_entries = prefix_text + new_text, prefix_ids + new_ids, prefix_entries + new_entries
    finish = _finish_reason(job, c)
    wants_logprobs = job.req.logprobs is not None
    if not new_text and not finish and not (wants_logprobs and new_ids):
        return None
    logprobs = job.logprobs(new_ids, new_entries, progress.offset) if wants_logprobs else None
    progress.chars, progress.tokens = len(text), len(token_ids)
    progress.offset += len(new_text)
    progress.started, progress.done = True, finish is not None
    return {"text": new_text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": c.stop_reason}


async def _chunks(job: _Job, stream: RequestStream) -> AsyncIterator[dict]:
    n = job.req.n
    progress: dict[int, _Progress] = {}
    finals: dict[int, RequestOutput] = {}
    async with stream:
        async for p, out in stream:
            finals[p] = out
            for c in out.outputs:
                index = p * n + c.index
                state = progress.setdefault(index, _Progress())
                if state.done:
                    continue
                choice = _delta(job, out, c, state)
                if choice is not None:
                    yield job.chunk([{"index": index, **choice}], finals)
    if job.req.stream_options and job.req.stream_options.include_usage:
        yield {**job.chunk([], finals), "usage": _usage(job, list(finals.values()))}
