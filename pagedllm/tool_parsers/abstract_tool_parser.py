"""ToolParser: turns a model's reply into OpenAI tool calls, whole (`extract`) or while it streams (`extract_delta`).

A parser says where the calls start (`split`) and how to read them (`parse_calls`); both take `final`: False while
more text may come, when they return only what later text cannot change (content before a possible call marker,
calls whose name is known, a prefix of their arguments' canonical JSON). Streaming re-reads the text so far at each
delta and sends what grew, so a streamed reply joins into exactly what `extract` gives for the whole."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass
class CallItem:
    """A call as far as it is known: its name (None: not yet) and its arguments' JSON text (a prefix while
    streaming; whole when final)."""

    name: str | None
    arguments: str = ""


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: make_call_id())

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None
    calls: list[ToolCall]


def make_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (they wait for the next delta)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """One instance per reply (it keeps the streaming state). `tools`: the request's tools (OpenAI's layout)."""

    start_marker = ""  # where the calls begin (marker-style formats)
    keeps_special_tokens = False  # the marker is a special token: the reply must be detokenized with it

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []
        self.text = ""
        self.sent_content = 0
        self.sent_calls: list[tuple[str, int]] = []  # per call index: (id, argument characters sent)

    # -- what each format defines -----------------------------------------------------------------------------
    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        """(the content, the text of the calls or None). Default: calls start at start_marker (the content before
        it, trailing whitespace dropped); while streaming, text that may begin the marker is held back."""
        idx = text.find(self.start_marker)
        if idx >= 0:
            return text[:idx].rstrip(), text[idx + len(self.start_marker) :]
        if final:
            return text, None
        return text[: len(text) - held_prefix(text, self.start_marker)].rstrip(), None

    def parse_calls(self, text: str, final: bool) -> list[CallItem]:
        """The calls in `text` (what follows the marker). Raises ValueError where it is malformed."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------------------------
    def _parse(self, text: str, final: bool) -> tuple[str, list[CallItem]]:
        content, calls_text = self.split(text, final)
        if calls_text is None:
            return content, []
        try:
            calls = self.parse_calls(calls_text, final)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            calls = None
        if final and not calls:  # no well-formed call: the whole reply is content
            return text, []
        return content, calls or []

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole reply: its content (None if empty) and its calls."""
        content, calls = self._parse(text, final=True)
        return ExtractedToolCalls(content or None, [ToolCall(c.name, c.arguments) for c in calls])

    def extract_delta(self, delta_text: str, final: bool = False) -> tuple[str, list[dict]]:
        """The next piece of a streamed reply: (new content, tool-call delta entries in OpenAI's layout: for a new
        call {index, id, type, function: {name, arguments: ""}}, then {index, function: {arguments: fragment}})."""
        self.text += delta_text
        content, calls = self._parse(self.text, final)
        new_content = content[self.sent_content :] if len(content) > self.sent_content else ""
        self.sent_content = max(self.sent_content, len(content))
        entries = []
        for index, call in enumerate(calls):
            if index == len(self.sent_calls):
                if call.name is None:
                    break
                call_id = make_call_id()
                self.sent_calls.append((call_id, 0))
                function = {"name": call.name, "arguments": ""}
                entries.append({"index": index, "id": call_id, "type": "function", "function": function})
            call_id, num_sent = self.sent_calls[index]
            if len(call.arguments) > num_sent:
                entries.append({"index": index, "function": {"arguments": call.arguments[num_sent:]}})
                self.sent_calls[index] = (call_id, len(call.arguments))
        return new_content, entries

    @property
    def called(self) -> bool:
        """Whether the streamed reply has sent a tool call."""
        return bool(self.sent_calls)
