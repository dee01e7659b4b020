"""Tool parsers: a model's reply -> OpenAI tool calls, chosen by name (`--tool-call-parser`). Each parser lives in
its own module, imported when it is chosen."""

from __future__ import annotations

import importlib

from pagedllm.tool_parsers.abstract_tool_parser import ExtractedToolCalls, ToolCall, ToolParser

_PARSERS = {
    "hermes": "hermes_tool_parser:HermesToolParser",
    "llama3_json": "llama3_json_tool_parser:Llama3JsonToolParser",
    "mistral": "mistral_tool_parser:MistralToolParser",
    "pythonic": "pythonic_tool_parser:PythonicToolParser",
    "qwen3_coder": "qwen3_xml_tool_parser:Qwen3XmlToolParser",
    "qwen3_xml": "qwen3_xml_tool_parser:Qwen3XmlToolParser",
}
TOOL_PARSER_NAMES = tuple(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name` (ValueError naming the known ones otherwise)."""
    if name not in _PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is not known: one of {', '.join(TOOL_PARSER_NAMES)}")
    module, cls = _PARSERS[name].split(":")
    return getattr(importlib.import_module(f"pagedllm.tool_parsers.{module}"), cls)


__all__ = ["TOOL_PARSER_NAMES", "ExtractedToolCalls", "ToolCall", "ToolParser", "get_tool_parser"]
