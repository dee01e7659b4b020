"""Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]f[ARGS]{...}` (one
marker per call). `[TOOL_CALLS]` is a special token, so the reply is detokenized with special tokens kept."""

from __future__ import annotations

from pagedllm.tool_parsers.abstract_tool_parser import CallItem, ToolParser
from pagedllm.tool_parsers.json_calls import call_array
from pagedllm.tool_parsers.json_scan import canonical, canonical_prefix, skip_ws, value_end

START, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    start_marker = START
    keeps_special_tokens = True

    def parse_calls(self, text: str, final: bool) -> list[CallItem]:
        i = skip_ws(text, 0)
        if i >= len(text):
            return []
        if text[i] == "[":
            return call_array(text, i, final)[0]
        calls: list[CallItem] = []
        for part in text.split(START):
            name, sep, args = part.partition(ARGS)
            if not sep:
                if final:
                    raise ValueError(f"a call without {ARGS}")
                break
            start = skip_ws(args, 0)
            end = value_end(args, start)
            if end is None:
                if final:
                    raise ValueError("unfinished arguments")
                calls.append(CallItem(name.strip(), canonical_prefix(args[start:])))
                break
            arguments = canonical(args[start:end])
            if not arguments.startswith("{"):
                raise ValueError("a call's arguments must be an object")
            calls.append(CallItem(name.strip(), arguments))
        return calls
