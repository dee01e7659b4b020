"""Qwen3-Coder XML tool calls: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
</tool_call>`. A value becomes the JSON type its tool's schema gives the parameter (a string where the schema says
so or says nothing); a parameter is sent once it is whole."""

from __future__ import annotations

import ast
import json

from pagedllm.tool_parsers.abstract_tool_parser import CallItem, ToolParser

START = "<tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def convert(value: str, kind: object) -> object:
    """A parameter's text as the JSON value its schema type names."""
    if kind is None or kind in ("string", "str", "text"):
        return value
    if value.strip().lower() == "null":
        return None
    try:
        if kind in ("integer", "int"):
            return int(value.strip())
        if kind in ("number", "float"):
            number = float(value.strip())
            return int(number) if number.is_integer() and value.strip().lstrip("-").isdigit() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(value.strip().lower(), value)
    for read in (json.loads, ast.literal_eval):  # objects, arrays and other types
        try:
            return read(value.strip())
        except (ValueError, SyntaxError, RecursionError):
            pass
    return value


class Qwen3XmlToolParser(ToolParser):
    start_marker = START

    def _types(self, name: str) -> dict:
        """Parameter name -> JSON schema type, from the request's tool of that name."""
        for tool in self.tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties") or {}
                return {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)}
        return {}

    def _arguments(self, body: str, name: str, whole: bool) -> str:
        """The arguments' canonical JSON: all of it when the function is whole, else its whole parameters."""
        types, parts, i = self._types(name), [], 0
        while (start := body.find(PARAMETER, i)) >= 0:
            key_end = body.find(">", start)
            if key_end < 0:
                break
            key = body[start + len(PARAMETER) : key_end].strip()
            end = body.find(PARAMETER_END, key_end)
            if end < 0:  # a missing end tag: the value runs to the next parameter (only once the function is whole)
                if not whole:
                    break
                end = body.find(PARAMETER, key_end)
                end = len(body) if end < 0 else end
            value = body[key_end + 1 : end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            parts.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(convert(value, types.get(key)))}")
            i = end
        return "{" + ", ".join(parts) + ("}" if whole else "")

    def parse_calls(self, text: str, final: bool) -> list[CallItem]:
        calls: list[CallItem] = []
        i = 0
        while (start := text.find(FUNCTION, i)) >= 0:
            name_end = text.find(">", start)
            if name_end < 0:
                break
            name = text[start + len(FUNCTION) : name_end].strip()
            if not name:
                raise ValueError("a function without a name")
            end = text.find(FUNCTION_END, name_end)
            whole = end >= 0 or final
            body = text[name_end + 1 : end if end >= 0 else len(text)]
            calls.append(CallItem(name, self._arguments(body, name, whole)))
            if end < 0:
                break
            i = end + len(FUNCTION_END)
        return calls
