"""The streamed /v1/responses: OpenAI's typed server-sent events (`event: <type>` and `data: {..., "type",
"sequence_number"}`), in the documented order:

    response.created, response.in_progress,
    per output item: response.output_item.added,
        a message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                     response.content_part.done
        reasoning:   response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                     response.content_part.done
        a call:      response.function_call_arguments.delta..., response.function_call_arguments.done
    response.output_item.done; then response.completed (response.incomplete at max_output_tokens).

The reply is read by the chat path's parsers (serving_tools.Reply.deltas); an item ends when the next kind starts.
Whitespace between tool calls opens no message (as in the whole response). An error after the status line ends
the stream with an `error` event."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

from pagedllm.entrypoints.openai.async_engine import EngineDeadError, RequestStream
from pagedllm.entrypoints.openai.protocol import APIError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class _Events:
    """Numbers the events and keeps the output item being written (kind, item, its text so far)."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[dict] = []  # the finished items
        self.current: dict | None = None
        self.pending = ""  # content not yet in a message: whitespace only
        self.called = False

    def event(self, kind: str, **fields) -> dict:
        body = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return body

    def _at(self) -> dict:
        return {"item_id": self.current["item"]["id"], "output_index": len(self.items)}

    def _open(self, kind: str, item: dict) -> Iterator[dict]:
        yield from self.close()
        self.current = {"kind": kind, "item": item, "text": ""}
        yield self.event("response.output_item.added", output_index=len(self.items), item=item)
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield self.event("response.content_part.added", **self._at(), content_index=0, part=part)
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            yield self.event("response.content_part.added", **self._at(), content_index=0, part=part)

    def _text(self, kind: str, delta: str) -> Iterator[dict]:
        if self.current is None or self.current["kind"] != kind:
            if kind == "message":
                item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress"}
            else:
                item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            yield from self._open(kind, {**item, "content": []})
        self.current["text"] += delta
        if not delta:
            return
        if kind == "message":
            yield self.event("response.output_text.delta", **self._at(), content_index=0, delta=delta, logprobs=[])
        else:
            yield self.event("response.reasoning_text.delta", **self._at(), content_index=0, delta=delta)

    def delta(self, delta: dict) -> Iterator[dict]:
        """The events of one chat delta message (reasoning_content, content or one tool-call entry)."""
        if delta.get("reasoning_content"):
            yield from self._text("reasoning", delta["reasoning_content"])
        content = delta.get("content")
        if content:
            if self.current is not None and self.current["kind"] == "message":
                yield from self._text("message", content)
            else:
                self.pending += content
                if self.pending.strip():
                    content, self.pending = self.pending, ""
                    yield from self._text("message", content)
        for entry in delta.get("tool_calls") or []:
            function = entry.get("function") or {}
            if entry.get("id") is not None:
                item = {"id": new_id("fc"), "type": "function_call", "call_id": entry["id"]}
                item = {**item, "name": function.get("name"), "arguments": "", "status": "in_progress"}
                self.called, self.pending = True, ""
                yield from self._open("function_call", item)
            arguments = function.get("arguments")
            if arguments and self.current is not None and self.current["kind"] == "function_call":
                self.current["text"] += arguments
                yield self.event("response.function_call_arguments.delta", **self._at(), delta=arguments)

    def close(self, status: str = "completed") -> Iterator[dict]:
        """Ends the item being written (its done events)."""
        if self.current is None:
            return
        kind, item, text = self.current["kind"], self.current["item"], self.current["text"]
        at = self._at()
        if kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=[])
            yield self.event("response.content_part.done", **at, content_index=0, part=part)
            item = {**item, "status": status, "content": [part]}
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            yield self.event("response.reasoning_text.done", **at, content_index=0, text=text)
            yield self.event("response.content_part.done", **at, content_index=0, part=part)
            item = {**item, "status": "completed", "content": [part]}
        else:
            yield self.event("response.function_call_arguments.done", **at, name=item["name"], arguments=text)
            item = {**item, "status": "completed", "arguments": text}
        yield self.event("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)
        self.current = None

    def finish(self, status: str) -> Iterator[dict]:
        """Ends the last item; a reply with neither text nor calls still gets its (empty) message."""
        has_message = any(item["type"] == "message" for item in self.items)
        current_message = self.current is not None and self.current["kind"] == "message"
        if not (has_message or current_message or self.called):
            yield from self._text("message", self.pending)
        yield from self.close(status)


async def response_events(job, stream: RequestStream, finished: Callable[[dict], None]) -> AsyncIterator[dict]:
    """The events of a streamed response; `finished` gets the final response object."""
    events = _Events()
    yield events.event("response.created", response=job.body("in_progress", [], None, None))
    yield events.event("response.in_progress", response=job.body("in_progress", [], None, None))
    reply, sent, final = None, 0, None
    async with stream:
        async for _, out in stream:
            c = out.outputs[0]
            if final is None:
                reply = job.chat.plan.reply(out.prompt)
            final = out
            new_text, sent = c.text[sent:], len(c.text)
            done = c.finish_reason is not None
            deltas = reply.deltas(new_text, done) if reply is not None else [{"content": new_text}]
            for delta in deltas:
                for event in events.delta(delta):
                    yield event
    finish_reason = final.outputs[0].finish_reason if final is not None else None
    status = status_of(finish_reason)
    for event in events.finish(status):
        yield event
    body = job.body(status, events.items, final, finish_reason)
    finished(body)
    yield events.event(f"response.{status}", response=body)


async def response_sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events with their type as the event name (no [DONE]: the terminal event ends the stream)."""
    sequence_number = 0
    try:
        async for event in events:
            sequence_number = event["sequence_number"] + 1
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
    except (APIError, EngineDeadError) as e:
        code = e.code if isinstance(e, APIError) else "server_error"
        param = e.param if isinstance(e, APIError) else None
        error = {"type": "error", "code": code, "message": str(e), "param": param, "sequence_number": sequence_number}
        yield f"event: error\ndata: {json.dumps(error, ensure_ascii=False)}\n\n"
