"""Hermes / Qwen 2.5 style: `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, one block per call; the
text before the first block is the content."""

from __future__ import annotations

from pagedllm.tool_parsers.abstract_tool_parser import CallItem, ToolParser
from pagedllm.tool_parsers.json_calls import call_object
from pagedllm.tool_parsers.json_scan import skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    start_marker = START

    def parse_calls(self, text: str, final: bool) -> list[CallItem]:
        calls: list[CallItem] = []
        i = skip_ws(text, 0)
        while i < len(text):
            call, end = call_object(text, i, final)
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if text.startswith(END, i):  # a missing end tag is forgiven
                i = skip_ws(text, i + len(END))
            if not text.startswith(START, i):
                break  # the text after the calls is not part of the reply's content (as vLLM)
            i = skip_ws(text, i + len(START))
        return calls
