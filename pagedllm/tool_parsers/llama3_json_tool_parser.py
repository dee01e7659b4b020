"""Llama 3.x JSON tool calls: the reply is `{"name": "f", "parameters": {...}}` (maybe after `<|python_tag|>`),
several separated by `;`. A reply that does not start so is plain content."""

from __future__ import annotations

from pagedllm.tool_parsers.abstract_tool_parser import CallItem, ToolParser
from pagedllm.tool_parsers.json_calls import call_object
from pagedllm.tool_parsers.json_scan import skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    keeps_special_tokens = True  # <|python_tag|> is a special token

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG):
            return "", stripped[len(PYTHON_TAG) :]
        if stripped.startswith("{"):
            return "", stripped
        if not final and PYTHON_TAG.startswith(stripped):  # nothing decided yet (empty or a part of the tag)
            return "", None
        return text, None

    def parse_calls(self, text: str, final: bool) -> list[CallItem]:
        calls: list[CallItem] = []
        i = skip_ws(text, 0)
        while i < len(text):
            call, end = call_object(text, i, final)
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i >= len(text) or text[i] != ";":
                break
            i = skip_ws(text, i + 1)
        return calls
