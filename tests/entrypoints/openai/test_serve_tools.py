"""Tool calling and reasoning on /v1/chat/completions: tool_choice "required" and a named function are forced by a
grammar (the arguments validate against the tool's schema, jsonschema is the oracle), "auto" reads hermes calls
from the reply, reasoning goes to reasoning_content and a structured output starts after it; streamed replies
(through the openai client) join into the non-streamed ones; tool messages and assistant tool_calls render
through the chat template; bad tools and tool choices are 400s naming the field."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

MODEL_NAME = "smollm2-test"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
CHAT = {"model": MODEL_NAME, "messages": ASK, "temperature": 0, "max_tokens": 80, "tools": TOOLS}


def _post(server, body: dict) -> dict:
    status, out = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, out
    return out


def _stream(server, body: dict) -> tuple[dict, str | None]:
    """A streamed reply through the openai client, joined: {content, reasoning_content, tool_calls}, finish."""
    client = server.client()
    extra = {k: v for k, v in body.items() if k not in ("model", "messages", "tools", "tool_choice")}
    known = {k: extra.pop(k) for k in ("temperature", "max_tokens", "parallel_tool_calls") if k in extra}
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=body["messages"],
        tools=body.get("tools", []) or None,
        tool_choice=body.get("tool_choice", "auto") if body.get("tools") else None,
        stream=True,
        extra_body=extra,
        **known,
    )
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.type == "function"
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    joined = [{"name": c["name"], "arguments": c["arguments"]} for c in calls.values()]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls.values())
    return {"content": content or None, "reasoning_content": reasoning or None, "tool_calls": joined}, finish


def _calls(message: dict) -> list[dict]:
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]


@pytest.mark.parametrize(
    "tool_choice,names,finish_reason",
    [
        ("required", {"get_weather", "get_time"}, "tool_calls"),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}, "stop"),  # OpenAI's and vLLM's
    ],
    ids=["required", "named"],
)
def test_forced_tool_calls(tool_server, tool_choice, names, finish_reason):
    body = {**CHAT, "tool_choice": tool_choice, "parallel_tool_calls": False, **NO_THINKING}
    out = _post(tool_server, body)
    choice = out["choices"][0]
    assert choice["finish_reason"] == finish_reason, choice
    assert choice["message"]["content"] is None
    calls = _calls(choice["message"])
    assert len(calls) == 1 and calls[0]["name"] in names
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])
    streamed, finish = _stream(tool_server, body)
    assert finish == finish_reason and streamed["tool_calls"] == calls and streamed["content"] is None


def test_auto_reads_hermes_calls(tool_server):
    reply = 'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'
    body = {**CHAT, "tool_choice": "auto", "guided_choice": [reply], **NO_THINKING}  # the reply, forced
    message = _post(tool_server, body)["choices"][0]["message"]
    expected = [{"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "C"})}]
    assert message["content"] == "Checking." and _calls(message) == expected
    streamed, finish = _stream(tool_server, body)
    assert finish == "tool_calls" and streamed["content"] == "Checking." and streamed["tool_calls"] == expected
    out = tool_server.client().chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80, extra_body=body
    )
    assert out.choices[0].finish_reason == "tool_calls"
    assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "C"}


def test_parallel_calls_whole_and_streamed(tool_server):
    """Two hermes calls in one reply: two tool_calls (ids apart), streamed as index 0 then index 1."""
    reply = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    body = {**CHAT, "tool_choice": "auto", "guided_choice": [reply], "max_tokens": 120, **NO_THINKING}
    message = _post(tool_server, body)["choices"][0]["message"]
    expected = [
        {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "C"})},
        {"name": "get_time", "arguments": json.dumps({"zone": "UTC"})},
    ]
    assert _calls(message) == expected and len({c["id"] for c in message["tool_calls"]}) == 2
    streamed, finish = _stream(tool_server, body)
    assert finish == "tool_calls" and streamed["tool_calls"] == expected


def test_reasoning_content_and_grammar_after_it(tool_server):
    base = {"model": MODEL_NAME, "messages": ASK, "temperature": 0, "max_tokens": 12}
    thought = _post(tool_server, base)["choices"][0]["message"]
    assert thought["content"] is None and thought["reasoning_content"]  # the reply never closed <think>
    streamed = _stream(tool_server, base)[0]
    assert streamed == {"content": None, "reasoning_content": thought["reasoning_content"], "tool_calls": []}
    # the grammar waits for the reasoning to end: while it does not, the reply is what it was unconstrained
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    gated = _post(tool_server, {**base, "guided_json": schema})["choices"][0]["message"]
    assert gated["reasoning_content"] == thought["reasoning_content"] and gated["content"] is None
    # thinking off (the prompt closes the section): the reply is content and follows the schema from the start
    answer = _post(tool_server, {**base, "max_tokens": 40, "guided_json": schema, **NO_THINKING})["choices"][0]
    assert answer["message"]["reasoning_content"] is None
    jsonschema.validate(json.loads(answer["message"]["content"]), schema)


def test_tool_messages_render_through_the_template(tool_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    status, tokens = tool_server.request("POST", "/tokenize", {"messages": messages, "tools": TOOLS})
    assert status == 200, tokens
    status, text = tool_server.request("POST", "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200
    assert '"name": "get_weather"' in text["prompt"] and '"description": "The weather in a city"' in text["prompt"]
    assert '"arguments": {"city": "Paris"}' in text["prompt"] and "[call_1] 21 C" in text["prompt"]
    out = _post(tool_server, {**CHAT, "messages": messages, "max_tokens": 2, "tool_choice": "none"})
    assert out["usage"]["prompt_tokens"] == tokens["count"]
    assert out["choices"][0]["message"]["tool_calls"] == []


@pytest.mark.parametrize(
    "change,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                        },
                    }
                ],
            },
            "tools",
        ),
    ],
)
def test_bad_tools_are_400(tool_server, change, param):
    status, body = tool_server.request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2, **change})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body


def test_auto_needs_the_flag(server):
    for change in ({"tool_choice": "auto"}, {}):  # "auto" is the default with tools
        status, body = server.request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2, **change})
        assert status == 400 and "--enable-auto-tool-choice" in body["error"]["message"], body
    status, body = server.request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 2, "tool_choice": "none"})
    assert status == 200 and body["choices"][0]["message"]["tool_calls"] == []


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--tool-call-parser", "nope"], "invalid choice: 'nope'"),
        (["--reasoning-parser", "nope"], "invalid choice: 'nope'"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ],
)
def test_bad_flags(flags, message):
    done = subprocess.run([sys.executable, "-m", "pagedllm", "serve", *flags], capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_required_schema():
    """The grammar of tool_choice "required": a non-empty array of {name, parameters} calls of the given tools,
    at most one unless parallel_tool_calls; jsonschema judges candidate replies."""
    from pagedllm.entrypoints.openai.serving_tools import _required_schema, check_tools

    functions = check_tools(TOOLS)
    one, many = _required_schema(functions, False), _required_schema(functions, None)
    weather = {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}
    time_ = {"name": "get_time", "parameters": {"zone": "UTC"}}
    jsonschema.validate([weather], one)
    jsonschema.validate([weather, time_], many)
    for bad, schema in [([], many), ([weather, time_], one), ([{"name": "get_time", "parameters": {}}], many)]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "parameters": {}}], many)
