"""Calls written as JSON objects, {"name": ..., "arguments" | "parameters": {...}}: one object, a sequence of them,
or a JSON array of them (hermes, llama3_json, mistral and the grammar of tool_choice "required" share this)."""

from __future__ import annotations

import json

from pagedllm.tool_parsers.abstract_tool_parser import CallItem
from pagedllm.tool_parsers.json_scan import canonical, canonical_prefix, object_members, skip_ws

ARGUMENT_KEYS = ("arguments", "parameters")


def call_object(text: str, pos: int, final: bool) -> tuple[CallItem | None, int | None]:
    """The call whose object starts at text[pos] == '{' and the index after it (None while incomplete)."""
    if pos >= len(text) or text[pos] != "{":
        raise ValueError(f"expected a call object at {pos}")
    members, end = object_members(text, pos)
    name = None
    if "name" in members and members["name"][1] is not None:
        name = json.loads(text[members["name"][0] : members["name"][1]])
        if not isinstance(name, str):
            raise ValueError("a call's name must be a string")
    key = next((k for k in ARGUMENT_KEYS if k in members), None)
    if end is None:
        if final:
            raise ValueError("an unfinished call")
        if key is None:
            return CallItem(name), None
        start, stop = members[key]
        return CallItem(name, canonical_prefix(text[start : stop if stop is not None else len(text)])), None
    if name is None:
        raise ValueError("a call without a name")
    arguments = "{}" if key is None else canonical(text[members[key][0] : members[key][1]])
    if not arguments.startswith("{"):
        raise ValueError("a call's arguments must be an object")
    return CallItem(name, arguments), end


def call_array(text: str, pos: int, final: bool) -> tuple[list[CallItem], int | None]:
    """The calls of the JSON array at text[pos] == '[' and the index after it (None while incomplete)."""
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"expected an array of calls at {pos}")
    calls: list[CallItem] = []
    i = skip_ws(text, pos + 1)
    while i < len(text):
        if text[i] == "]":
            return calls, i + 1
        if text[i] == "," and calls:
            i = skip_ws(text, i + 1)
            continue
        call, end = call_object(text, i, final)
        calls.append(call)
        if end is None:
            return calls, None
        i = skip_ws(text, end)
    if final:
        raise ValueError("an unfinished array of calls")
    return calls, None
