"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it) on the chat path: the request becomes a chat
completions request (protocol_responses.py), prepared and generated as one (same template, sampling, structured
outputs, tool parsing), and the reply is written as a `response` object: a `reasoning` item (with
--reasoning-parser), a `message` item with `output_text`, `function_call` items. Streamed as OpenAI's typed events
(responses_stream.py).

store, only on a server started with VLLM_ENABLE_RESPONSES_API_STORE=1 (off by default, as vLLM's; there store=true
and previous_response_id are 400s): a finished response (store not false) and its conversation are kept in memory,
the newest STORE_MAX_RESPONSES within STORE_MAX_CHARS (the oldest dropped first), for GET /v1/responses/{id}, DELETE
and a later request's previous_response_id; lost when the server stops. A stored response's id is random; any
client with the API key may read one by its id."""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm import envs
from pagedllm.entrypoints.openai.protocol import APIError, now
from pagedllm.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    input_messages,
    refuse_fields,
    to_chat_request,
)
from pagedllm.entrypoints.openai.responses_stream import new_id, response_events, response_sse, status_of
from pagedllm.entrypoints.openai.serving_chat import ChatJob, collect, generate_chat, prepare_chat
from pagedllm.entrypoints.openai.serving_utils import ServerState, response_id, unless_disconnected
from pagedllm.outputs import RequestOutput

STORE_MAX_RESPONSES = 1000
STORE_MAX_CHARS = 64 << 20


class ResponseStore:
    """Finished responses by id with the conversation that led to them (instructions left out), bounded."""

    def __init__(
        self, enabled: bool = True, max_responses: int = STORE_MAX_RESPONSES, max_chars: int = STORE_MAX_CHARS
    ) -> None:
        self.enabled = enabled  # VLLM_ENABLE_RESPONSES_API_STORE (off by default, as vLLM's)
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self._chars = 0

    def put(self, body: dict, messages: list[dict]) -> None:
        size = len(json.dumps(body)) + len(json.dumps(messages))
        self.delete(body["id"])
        self._items[body["id"]] = (body, messages, size)
        self._chars += size
        while self._items and (len(self._items) > self.max_responses or self._chars > self.max_chars):
            self._chars -= self._items.popitem(last=False)[1][2]

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        item = self._items.get(response_id)
        return None if item is None else item[:2]

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is not None:
            self._chars -= item[2]
        return item is not None


@dataclass
class ResponseJob:
    """One response in the making: the request, its chat job, and what the response object echoes."""

    req: ResponsesRequest
    chat: ChatJob
    temperature: float | None
    top_p: float | None
    created_at: int

    keeps: bool = False  # the response goes into the store (enabled, and store not false)

    @property
    def store(self) -> bool:
        return self.keeps

    def body(self, status: str, output: list[dict], out: RequestOutput | None, finish_reason: str | None) -> dict:
        """The response object; status "in_progress" while streaming, then "completed" or "incomplete"."""
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {
            "id": self.chat.request_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": incomplete if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": self.chat.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None,
            "service_tier": req.service_tier,
            "store": self.store,
            "temperature": self.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": _usage(out) if out is not None else None,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _usage(out: RequestOutput) -> dict:
    num_input = len(out.prompt_token_ids or [])
    num_output = sum(len(c.token_ids) for c in out.outputs)
    return {
        "input_tokens": num_input,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens or 0},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_input + num_output,
    }


def message_item(text: str, status: str, item_id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    item = {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status}
    return {**item, "content": [part]}


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {
        "id": item_id or new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": content,
        "status": "completed",
    }


def function_call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict:
    item = {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name}
    return {**item, "arguments": arguments, "status": "completed"}


def _output(job: ChatJob, out: RequestOutput) -> tuple[list[dict], str | None]:
    """The output items of a finished request, and its finish reason."""
    c = out.outputs[0]
    status = status_of(c.finish_reason)
    reply = job.plan.reply(out.prompt)
    if reply is None:
        return [message_item(c.text, status)], c.finish_reason
    fields = reply.message(c.text)
    items = [reasoning_item(fields["reasoning_content"])] if fields.get("reasoning_content") else []
    content, calls = fields["content"] or "", fields["tool_calls"]
    if content.strip() or not calls:  # the whitespace around tool calls is no message
        items.append(message_item(content, status))
    for call in calls:
        items.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items, c.finish_reason


def _renamed(e: APIError) -> APIError:
    """An error about the chat request's response_format is about the request's text.format."""
    if e.param == "response_format":
        e.message, e.param = e.message.replace("response_format", "text.format"), "text"
    return e


def check_store(store: ResponseStore, req: ResponsesRequest) -> bool:
    """Whether the response is kept; 400 for store=true or previous_response_id on a server that keeps none."""
    if not store.enabled:
        for name, given in (("store", req.store is True), ("previous_response_id", req.previous_response_id)):
            if given:
                message = (
                    f"{name}: this server keeps no responses; start it with VLLM_ENABLE_RESPONSES_API_STORE=1 "
                    "(as vLLM's), or send store=false"
                )
                raise APIError(message, 400, param=name)
    return store.enabled and req.store is not False


async def create_response(state: ServerState, store: ResponseStore, req: ResponsesRequest, raw: Request):
    refuse_fields(req)
    keeps = check_store(store, req)
    history: list[dict] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            message = (
                f"previous_response_id={req.previous_response_id!r}: no stored response has this id (responses are "
                "kept in this server's memory when store is true, the newest first)"
            )
            raise APIError(message, 400, param="previous_response_id", code="response_not_found")
        body, messages = found
        history = messages + input_messages(body["output"], "output")
    chat_req = to_chat_request(req, history)
    # a stored response's id is random (never the client's request_id or X-Request-Id): ids cannot be guessed
    request_id = "resp_" + (uuid.uuid4().hex if keeps else response_id("resp", req, raw)[len("resp-") :])
    try:
        chat, params, make_prompts, check = prepare_chat(state, chat_req, raw, request_id)
        stream = await generate_chat(state, chat, params, make_prompts, check)
    except APIError as e:
        raise _renamed(e) from None
    job = ResponseJob(req, chat, params.temperature, params.top_p, now(), keeps)
    conversation = chat_req.messages[1:] if req.instructions else chat_req.messages

    def finished(body: dict) -> None:
        if job.store:
            store.put(body, conversation)

    if req.stream:
        events = response_events(job, stream, finished)
        return StreamingResponse(response_sse(events), media_type="text/event-stream")
    try:
        final = await unless_disconnected(raw, collect(stream))
    except APIError as e:
        raise _renamed(e) from None
    output, finish_reason = _output(chat, final)
    body = job.body(status_of(finish_reason), output, final, finish_reason)
    finished(body)
    return JSONResponse(body)


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    store = ResponseStore(enabled=envs.responses_api_store())

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request):
        return await create_response(state, store, req, raw)

    def stored(response_id: str) -> tuple[dict, list[dict]]:
        found = store.get(response_id)
        if found is None:
            raise APIError(f"Response with id {response_id!r} not found.", 404, "not_found_error", "response_id")
        return found

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return stored(response_id)[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        stored(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
