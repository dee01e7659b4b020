"""Pythonic tool calls (Llama 3.2 / 4 style): the reply is a Python list of calls, `[f(a=1, b="x"), g()]`, with
literal keyword arguments; they become JSON arguments. A call is sent once it is whole."""

from __future__ import annotations

import ast
import json

from pagedllm.tool_parsers.abstract_tool_parser import CallItem, ToolParser


def _call(source: str) -> CallItem:
    node = ast.parse(source.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError(f"not a call with keyword arguments: {source!r}")
    arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    if None in arguments:
        raise ValueError("**kwargs in a call")
    return CallItem(node.func.id, json.dumps(arguments, ensure_ascii=False))


class PythonicToolParser(ToolParser):
    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        stripped = text.lstrip()
        if stripped.startswith("["):
            return "", stripped
        if not final and not stripped:
            return "", None
        return text, None

    def parse_calls(self, text: str, final: bool) -> list[CallItem]:
        """The whole calls of the list at text[0] == '[' (each ends at a top-level ',' or the closing ']')."""
        calls: list[CallItem] = []
        depth, start, quote, i = 0, 1, None, 1
        while i < len(text):
            ch = text[i]
            if quote is not None:
                if ch == "\\":
                    i += 1
                elif ch == quote:
                    quote = None
            elif ch in "'\"":
                quote = ch
            elif ch in "([{":
                depth += 1
            elif ch in ")}" or (ch == "]" and depth > 0):
                depth -= 1
            elif ch in ",]" and depth == 0:
                if text[start:i].strip() or ch == ",":
                    calls.append(_call(text[start:i]))
                if ch == "]":
                    if final and text[i + 1 :].strip():
                        raise ValueError("text after the list of calls")
                    return calls
                start = i + 1
            i += 1
        if final:
            raise ValueError("an unfinished list of calls")
        return calls
