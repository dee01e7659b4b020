"""Tool calling and reasoning output on chat completions.

`tools` and `tool_choice` ("none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}) become
a ReplyPlan: "required" and a named function are guaranteed by a JSON-schema grammar built from the tools'
parameter schemas (an array of {name, parameters} calls, or the named function's arguments), written as compact
JSON; "auto" reads the reply
with the server's tool parser (--tool-call-parser, with --enable-auto-tool-choice). With --reasoning-parser the
reply's <think> section goes to `reasoning_content` first. A Reply reads one choice, whole or streamed."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.protocol import APIError
from pagedllm.reasoning import get_reasoning_parser
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.tool_parsers import ToolParser, get_tool_parser
from pagedllm.tool_parsers.abstract_tool_parser import CallItem
from pagedllm.tool_parsers.json_calls import call_array

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_CHOICES = ("none", "auto", "required")


def _bad(message: str, param: str) -> APIError:
    return APIError(message, 400, param=param)


class RequiredToolParser(ToolParser):
    """The reply of tool_choice "required": the grammar's JSON array [{"name": ..., "parameters": {...}}, ...]."""

    def split(self, text: str, final: bool) -> tuple[str, str | None]:
        return "", text

    def parse_calls(self, text: str, final: bool) -> list[CallItem]:
        start = len(text) - len(text.lstrip())
        return call_array(text, start, final)[0] if start < len(text) else []


def named_parser(name: str) -> type[ToolParser]:
    """The reply of a named tool_choice: the grammar makes it the function's arguments, sent as they come."""

    class NamedToolParser(ToolParser):
        def split(self, text: str, final: bool) -> tuple[str, str | None]:
            return "", text

        def parse_calls(self, text: str, final: bool) -> list[CallItem]:
            return [CallItem(name, text)] if text.strip() or final else []

    return NamedToolParser


def check_tools(tools: Any) -> dict[str, dict]:
    """The request's functions by name; a malformed tool is a 400 naming it."""
    if not isinstance(tools, list):
        raise _bad("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad(f"{where}.type must be 'function'", "tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _bad(f"{where}.function must be an object with a name", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{where}.function.name={name!r}: 1 to 64 letters, digits, '_', '-', '.' or ':'", "tools")
        if name in functions:
            raise _bad(f"{where}.function.name={name!r} is given twice", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad(f"{where}.function.parameters must be a JSON schema object", "tools")
        functions[name] = function
    return functions


def _required_schema(functions: dict[str, dict], parallel: bool | None) -> dict:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for name, function in functions.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema if parallel is not False else {**schema, "maxItems": 1}


@dataclass
class ReplyPlan:
    """How a request's replies are read: a tool parser (None: no tool calls) and a reasoning parser."""

    tool_parser: type[ToolParser] | None = None
    tools: list | None = None
    reasoning_parser: Any = None
    named: bool = False  # a named function was forced: its reply ends with "stop", not "tool_calls" (OpenAI's)

    def finish_reason(self, reply: Reply | None, finish_reason: str | None) -> str | None:
        """The engine's finish reason, but "tool_calls" where the reply called tools and stopped (tool_choice auto
        or required)."""
        called = reply is not None and reply.called and not self.named
        return "tool_calls" if called and finish_reason == "stop" else finish_reason

    def reply(self, prompt: str | None) -> Reply | None:
        if self.tool_parser is None and self.reasoning_parser is None:
            return None
        return Reply(self, prompt)


def _choice(req: Any, functions: dict[str, dict]) -> str:
    """tool_choice as "none", "auto", "required" or the named function (400 when it is none of those)."""
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise _bad(
                f"tool_choice={choice!r} is not supported: 'none', 'auto', 'required' or a function", "tool_choice"
            )
        if choice != "none" and not req.tools:
            raise _bad(f"tool_choice={choice!r} needs tools", "tool_choice")
        return choice
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _bad("tool_choice must be {'type': 'function', 'function': {'name': NAME}}", "tool_choice")
    if name not in functions:
        raise _bad(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    return name


def plan_tools(state: Any, req: Any, params: SamplingParams) -> ReplyPlan:
    """Checks tools and tool_choice, adds the grammar of a forced call to `params`, and says how to read replies."""
    functions = check_tools(req.tools) if req.tools is not None else {}
    choice = _choice(req, functions)
    reasoning = get_reasoning_parser(state.reasoning_parser) if state.reasoning_parser else None
    plan = ReplyPlan(None, req.tools, reasoning)
    if choice == "none":
        return plan
    if choice == "auto":
        if not (state.enable_auto_tools and state.tool_parser):
            raise _bad(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', "tool_choice"
            )
        plan.tool_parser = get_tool_parser(state.tool_parser)
        if plan.tool_parser.keeps_special_tokens:
            params.skip_special_tokens = False  # its marker is a special token
        return plan
    if params.structured_outputs is not None:
        raise _bad(f"tool_choice={req.tool_choice!r} cannot be combined with another structured output", "tool_choice")
    if choice == "required":
        schema, plan.tool_parser = _required_schema(functions, req.parallel_tool_calls), RequiredToolParser
    else:
        schema, plan.tool_parser = functions[choice].get("parameters") or {"type": "object"}, named_parser(choice)
        plan.named = True
    try:
        # compact JSON (", " and ": " only): with free whitespace a small model may write newlines until max_tokens
        forced = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        params.structured_outputs = params.guided_decoding = forced
    except (ValueError, TypeError) as e:
        raise _bad(f"tools: {e}", "tools") from None
    return plan


class Reply:
    """One choice's reply read through the plan's parsers: whole (`message`) or streamed (`deltas`)."""

    def __init__(self, plan: ReplyPlan, prompt: str | None) -> None:
        self.reasoning = plan.reasoning_parser(prompt) if plan.reasoning_parser else None
        self.tools = plan.tool_parser(plan.tools) if plan.tool_parser else None
        self.called = False

    def message(self, text: str) -> dict:
        """{content, reasoning_content?, tool_calls} of a whole reply."""
        out: dict = {}
        content: str | None = text
        if self.reasoning is not None:
            out["reasoning_content"], content = self.reasoning.extract(text)
        calls = []
        if self.tools is not None:
            extracted = self.tools.extract(content or "")
            content, calls = extracted.content, [c.to_openai() for c in extracted.calls]
        self.called = bool(calls)
        return {"content": content, **out, "tool_calls": calls}

    def deltas(self, new_text: str, final: bool) -> list[dict]:
        """The delta messages for the next piece of a streamed reply (each tool-call entry in its own)."""
        out = []
        content = new_text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_delta(new_text, final)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        entries = []
        if self.tools is not None:
            content, entries = self.tools.extract_delta(content, final)
            self.called = self.tools.called
        if content:
            out.append({"content": content})
        return out + [{"tool_calls": [entry]} for entry in entries]
