"""POST /v1/chat/completions: the conversation is rendered with the chat template (the same function LLM.chat
uses, so the server's greedy replies equal the offline ones), then generated like a completion; OpenAI's
chat.completion response and chat.completion.chunk stream, logprobs in the chat layout.

`echo` (vLLM's): the last message's content goes in front of the reply when its role is the reply's role (the
assistant's with add_generation_prompt, else the last message's own), as a separate chunk when streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError

from pagedllm.entrypoints.chat_utils import apply_chat_template
from pagedllm.entrypoints.openai.async_engine import RequestStream
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, from_value_error, now
from pagedllm.entrypoints.openai.serving_beam import beam_search, refuse_with_beam_search
from pagedllm.entrypoints.openai.serving_structured import grammar_check, structured_outputs
from pagedllm.entrypoints.openai.serving_tools import Reply, ReplyPlan, plan_tools
from pagedllm.entrypoints.openai.serving_utils import (
    ServerState,
    bad,
    chat_logprobs,
    check_limit,
    context_check,
    prompt_logprobs_json,
    response_id,
    sampling_params,
    sse_stream,
    unless_disconnected,
    usage,
)
from pagedllm.multimodal.inputs import ProcessedPair
from pagedllm.outputs import CompletionOutput, RequestOutput


@dataclass
class ChatJob:
    req: ChatCompletionRequest
    model: str
    request_id: str
    created: int
    tokenizer: object
    plan: ReplyPlan
    response_role: str = "assistant"

    @property
    def role(self) -> str:
        return self.response_role if self.req.add_generation_prompt else str(self.req.messages[-1].get("role"))

    def echo_text(self) -> str:
        """What echo puts in front of the reply: the last message's content if its role is the reply's."""
        last = self.req.messages[-1] if self.req.messages else {}
        if not self.req.echo or last.get("role") != self.role:
            return ""
        content = last.get("content") or ""
        if isinstance(content, list):
            return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
        return str(content)

    def chunk(self, choices: list[dict], out: RequestOutput | None = None, opening: bool = False) -> dict:
        """A stream chunk; with continuous_usage_stats, the usage so far of `out` (none generated in the opening)."""
        body = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
        body["choices"] = choices
        options = self.req.stream_options
        if options and options.include_usage:
            body["usage"] = None
            if options.continuous_usage_stats and out is not None:
                body["usage"] = usage(len(out.prompt_token_ids), 0, out.num_cached_tokens) if opening else _usage(out)
        return body

    def logprobs(self, token_ids: list[int], entries: list | None) -> dict | None:
        if not self.req.logprobs or entries is None:
            return None
        as_ids = bool(self.req.return_tokens_as_token_ids)
        return {"content": chat_logprobs(self.tokenizer, token_ids, entries, self.req.top_logprobs or 0, as_ids)}


def _usage(out: RequestOutput) -> dict:
    num_generated = sum(len(c.token_ids) for c in out.outputs)
    return usage(len(out.prompt_token_ids), num_generated, out.num_cached_tokens)


def render_chat(
    state: ServerState,
    messages: list,
    add_special_tokens: bool = False,
    check_chars: bool = False,
    mm_processor_kwargs: dict | None = None,
    **options,
):
    """A function for a preparation thread: the conversation -> [(prompt text, prompt token ids)]. The template
    writes the special tokens; add_special_tokens=True has the tokenizer add its own too (vLLM's field).
    check_chars: refuse messages far too long for the context before rendering them (see max_prompt_chars).
    A model that takes images gets the conversation's image parts processed: the pair carries their features."""
    tokenizer = state.llm.get_tokenizer()
    engine = state.engine.engine
    model_path = engine.config.model.model_path

    def make_prompts() -> list[tuple[str | None, list[int]]]:
        if check_chars:
            state.check_prompt_chars(sum(_content_chars(m) for m in messages), "messages")
        media = getattr(engine, "chat_media", lambda: None)()  # None: a text-only model (an image part is a 400)
        try:
            text, ids = apply_chat_template(
                tokenizer,
                messages,
                chat_template=state.chat_template,
                chat_template_content_format=state.chat_template_content_format,
                model_path=model_path,
                media=media,
                **options,
            )
        except TemplateError as e:
            raise ValueError(f"messages: the chat template failed to render them: {e}") from None
        if media is not None and media.mm_data():
            mm = media.mm_data()
            ids, features = engine.process_multimodal(text, mm, mm_processor_kwargs, add_special_tokens, "messages")
            return [ProcessedPair(text, ids, features)]
        if add_special_tokens:
            ids = tokenizer.encode(text, add_special_tokens=True)
        return [(text, ids)]

    return make_prompts


def _content_chars(message: object) -> int:
    """Characters of a message's text content (a string, or a list of parts with "text")."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _check(state: ServerState, req: ChatCompletionRequest) -> None:
    if req.chat_template is not None:
        message = "chat_template: a request may not bring its own template; start the server with --chat-template"
        raise bad(message, "chat_template")
    check_limit(req.top_logprobs, state.limits.max_logprobs, "top_logprobs")
    check_limit(req.prompt_logprobs, state.limits.max_logprobs, "prompt_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad("top_logprobs needs logprobs=true", "top_logprobs")
    if req.stream and req.prompt_logprobs is not None:
        raise bad("prompt_logprobs are not available when stream=true (as vLLM)", "prompt_logprobs")
    if req.documents is not None and "documents" in (req.chat_template_kwargs or {}):
        raise bad("documents: given twice (also in chat_template_kwargs); give it once", "documents")


def _template_kwargs(state: ServerState, req: ChatCompletionRequest) -> dict | None:
    """chat_template_kwargs over the server's defaults, with `documents` (retrieval-augmented templates read that
    variable) added."""
    kwargs = {**state.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
    if req.documents is not None:
        kwargs["documents"] = req.documents
    return kwargs or req.chat_template_kwargs


def prepare_chat(state: ServerState, req: ChatCompletionRequest, raw: Request, request_id: str | None = None):
    """The checks and preparation of a chat request, shared with /v1/responses (serving_responses.py): (job,
    sampling params, the prompt-making function for the preparation thread, the check of its prompts)."""
    model = state.check_model(req.model)
    state.require_generate()
    _check(state, req)
    state.apply_defaults(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(state, req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs)
    if req.stream and params.best_of is not None and params.best_of != params.n:
        raise bad("best_of must equal n when streaming (the best sequences are known only at the end)", "best_of")
    constrained = params.structured_outputs is not None
    plan = plan_tools(state, req, params)
    if params.use_beam_search and params.structured_outputs is not None:
        raise bad(f"tool_choice={req.tool_choice!r} cannot be combined with use_beam_search", "tool_choice")
    make_prompts = render_chat(
        state,
        req.messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        tools=req.tools,
        chat_template_kwargs=_template_kwargs(state, req),
        add_special_tokens=req.add_special_tokens,
        check_chars=req.truncate_prompt_tokens is None,
        mm_processor_kwargs=req.mm_processor_kwargs,
    )
    request_id = request_id or response_id("chatcmpl", req, raw)
    job = ChatJob(req, model, request_id, now(), state.llm.get_tokenizer(), plan, state.response_role)
    check = context_check(state.max_model_len, max_tokens, req.truncate_prompt_tokens)
    field = structured_outputs(req)[1] if constrained else "tools"  # a forced tool call's grammar: from the tools
    check = grammar_check(state.engine.engine, params, field, check)
    return job, params, make_prompts, check


async def generate_chat(state: ServerState, job: ChatJob, params, make_prompts, check) -> RequestStream:
    """Starts the prepared request on the engine (a bad prompt is a 400)."""
    req = job.req
    try:
        return await state.engine.generate(
            make_prompts,
            1,
            params,
            job.request_id,
            check=check,
            cache_salt=req.cache_salt,
            lora_request=state.lora_request(req.model),
        )
    except (ValueError, TypeError) as e:
        raise from_value_error(e, "messages") from None


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    job, params, make_prompts, check = prepare_chat(state, req, raw)
    if params.use_beam_search:
        refuse_with_beam_search(bool(req.stream), req.logprobs, req.prompt_logprobs is not None)
        lora = state.lora_request(req.model)
        work = beam_search(state.engine, make_prompts, params, job.request_id, check, req.cache_salt, lora)
        try:
            return JSONResponse(_response(job, (await unless_disconnected(raw, work))[0]))
        except (ValueError, TypeError) as e:
            raise from_value_error(e, "messages") from None
    stream = await generate_chat(state, job, params, make_prompts, check)
    if req.stream:
        return StreamingResponse(sse_stream(_chunks(job, stream)), media_type="text/event-stream")
    final = await unless_disconnected(raw, collect(stream))
    return JSONResponse(_response(job, final))


async def collect(stream: RequestStream) -> RequestOutput:
    final = None
    async with stream:
        async for _, out in stream:
            final = out
    return final


def _message(job: ChatJob, c: CompletionOutput, prompt: str | None) -> tuple[dict, str | None]:
    """A choice's message and finish_reason (see ReplyPlan.finish_reason)."""
    echo = job.echo_text()
    reply = job.plan.reply(prompt)
    if reply is None:
        return {"role": job.role, "content": echo + c.text, "refusal": None, "tool_calls": []}, c.finish_reason
    fields = reply.message(c.text)
    if echo:
        fields["content"] = echo + (fields["content"] or "")
    return {"role": job.role, "refusal": None, **fields}, job.plan.finish_reason(reply, c.finish_reason)


def _response(job: ChatJob, out: RequestOutput) -> dict:
    choices = []
    for c in out.outputs:
        message, finish_reason = _message(job, c, out.prompt)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": job.logprobs(c.token_ids, c.logprobs),
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    body = {"id": job.request_id, "object": "chat.completion", "created": job.created, "model": job.model}
    if job.req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    return {**body, "choices": choices, "usage": _usage(out)}


def _deltas(job: ChatJob, c: CompletionOutput, sent: list[int], reply: Reply | None) -> list[dict]:
    """The next chunk choices of one sequence; sent = [characters, tokens] already sent (updated). With a reply
    parser, one per delta message (reasoning, content, each tool-call entry), the finish_reason on the last."""
    new_text = c.text[sent[0] :]
    new_ids = c.token_ids[sent[1] :]
    wants_logprobs = bool(job.req.logprobs)
    if not new_text and c.finish_reason is None and not (wants_logprobs and new_ids):
        return []
    entries = (c.logprobs or [])[sent[1] :] if c.logprobs is not None else None
    sent[0], sent[1] = len(c.text), len(c.token_ids)
    finished = c.finish_reason is not None
    deltas = reply.deltas(new_text, finished) if reply is not None else [{"content": new_text}]
    if not deltas and not finished and not (wants_logprobs and new_ids):
        return []
    deltas = deltas or [{"content": ""}]
    finish = job.plan.finish_reason(reply, c.finish_reason)
    last = len(deltas) - 1
    return [
        {
            "index": c.index,
            "delta": delta,
            "logprobs": job.logprobs(new_ids, entries) if i == 0 else None,
            "finish_reason": finish if i == last else None,
            "stop_reason": c.stop_reason if i == last else None,
        }
        for i, delta in enumerate(deltas)
    ]


def _opening(job: ChatJob, out: RequestOutput | None) -> list[dict]:
    """The first chunks: the role, then the echoed content (if any)."""
    n, echo = job.req.n, job.echo_text()
    role = {"role": job.role, "content": ""}
    chunks = [
        job.chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None} for i in range(n)], out, True)
    ]
    if echo:
        delta = {"content": echo}
        chunks += [
            job.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}], out) for i in range(n)
        ]
    return chunks


async def _chunks(job: ChatJob, stream: RequestStream) -> AsyncIterator[dict]:
    sent = {i: [0, 0] for i in range(job.req.n)}
    replies: dict[int, Reply | None] = {}
    done: set[int] = set()
    final = None
    async with stream:
        async for _, out in stream:
            if final is None:  # the opening waits for the first output: its usage needs the prompt's length
                for chunk in _opening(job, out):
                    yield chunk
            final = out
            for c in out.outputs:
                if c.index in done:
                    continue
                if c.index not in replies:
                    replies[c.index] = job.plan.reply(out.prompt)
                for choice in _deltas(job, c, sent[c.index], replies[c.index]):
                    yield job.chunk([choice], out)
                if c.finish_reason is not None:
                    done.add(c.index)
    if final is None:
        for chunk in _opening(job, None):
            yield chunk
    elif job.req.stream_options and job.req.stream_options.include_usage:
        yield {**job.chunk([]), "usage": _usage(final)}
