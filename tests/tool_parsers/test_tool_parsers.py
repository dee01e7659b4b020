"""Each tool parser on its format: a whole reply gives the expected content and calls (arguments compared as parsed
JSON, names exact), and the same reply streamed, split at every character boundary and one character at a time,
joins into exactly the same content, names and argument texts; malformed calls leave the reply as content (whole:
all of it; streamed: the content joins into the whole reply, though a call already sent stays sent)."""

from __future__ import annotations

import json

import pytest

from pagedllm.tool_parsers import TOOL_PARSER_NAMES, get_tool_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "ratio": {"type": "number"},
                "tags": {"type": "array"},
                "zip": {"type": "string"},
            },
        },
    },
}
TOOLS = [WEATHER]
ARGS = {"city": 'Pa"ris \\ é 😀', "days": 3, "tags": ["a", {"b": None}], "ratio": 1.5}

# parser -> [(reply, content, [(name, arguments)])]
CASES = {
    "hermes": [
        (
            "Let me check.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGS}) + "\n</tool_call>",
            "Let me check.",
            [("get_weather", ARGS)],
        ),
        (
            '<tool_call>{"arguments": {"x": 1e2}, "name": "f"}</tool_call>\n<tool_call>{"name": "g"}</tool_call>',
            None,
            [("f", {"x": 100.0}), ("g", {})],
        ),
        ('<tool_call>{"name": "f", "arguments": {"s": "\\ud83d\\ude00\\n"}}', None, [("f", {"s": "😀\n"})]),
        ("No tools needed <tool_ here.", "No tools needed <tool_ here.", []),
        (
            'Broken <tool_call>{"name": "f", "arguments": {"a": }</tool_call>',
            'Broken <tool_call>{"name": "f", "arguments": {"a": }</tool_call>',
            [],
        ),
    ],
    "llama3_json": [
        (json.dumps({"name": "get_weather", "parameters": ARGS}), None, [("get_weather", ARGS)]),
        (
            '<|python_tag|>{"name": "f", "parameters": {"n": -2}}; {"name": "g", "parameters": {}}',
            None,
            [("f", {"n": -2}), ("g", {})],
        ),
        ("The answer is 4.", "The answer is 4.", []),
        ('{"not": "a call"}', '{"not": "a call"}', []),
    ],
    "mistral": [
        (
            "Sure. [TOOL_CALLS]"
            + json.dumps([{"name": "get_weather", "arguments": ARGS}, {"name": "g", "arguments": {}}]),
            "Sure.",
            [("get_weather", ARGS), ("g", {})],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]g[ARGS]{}',
            None,
            [("get_weather", {"city": "Oslo"}), ("g", {})],
        ),
        ("Just text [TOOL", "Just text [TOOL", []),
    ],
    "pythonic": [
        (
            '[get_weather(city="Pa\\"ris", days=3, tags=["a", {"b": None}]), now()]',
            None,
            [("get_weather", {"city": 'Pa"ris', "days": 3, "tags": ["a", {"b": None}]}), ("now", {})],
        ),
        ("[f(x='a,b]c', y=(1, 2))]", None, [("f", {"x": "a,b]c", "y": [1, 2]})]),
        ("It is 4.", "It is 4.", []),
        ("[1, 2] are numbers", "[1, 2] are numbers", []),
    ],
    "qwen3_coder": [
        (
            "I will call it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=ratio>\n0.5\n"
            '</parameter>\n<parameter=tags>\n["x", 2]\n</parameter>\n<parameter=zip>\n00123\n</parameter>\n'
            "</function>\n</tool_call>",
            "I will call it.",
            [
                (
                    "get_weather",
                    {
                        "city": "San Francisco",
                        "days": 3,
                        "metric": True,
                        "ratio": 0.5,
                        "tags": ["x", 2],
                        "zip": "00123",
                    },
                )
            ],
        ),
        (
            "<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n<parameter=q>\n"
            "line1\nline2\n</parameter>\n</function>\n</tool_call>",
            None,
            [("a", {}), ("b", {"q": "line1\nline2"})],
        ),
        ("plain <tool", "plain <tool", []),
    ],
}
MALFORMED = {CASES["hermes"][4][0]}


def _streamed(parser_cls, pieces: list[str]):
    """(content, [(name, arguments text)], ids) joined from the deltas of a streamed reply."""
    parser = parser_cls(TOOLS)
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        delta, entries = parser.extract_delta(piece, final=k == len(pieces) - 1)
        content += delta
        for entry in entries:
            if "id" in entry:
                assert entry["index"] == len(calls) and entry["type"] == "function"
                assert entry["function"]["arguments"] == ""
                calls[entry["index"]] = [entry["function"]["name"], "", entry["id"]]
            else:
                assert set(entry) == {"index", "function"} and entry["index"] in calls
                calls[entry["index"]][1] += entry["function"]["arguments"]
    return content, [(name, args) for name, args, _ in calls.values()], [i for *_, i in calls.values()]


@pytest.mark.parametrize("name,case", [(n, c) for n, cases in CASES.items() for c in cases])
def test_extract_and_stream(name, case):
    reply, content, expected = case
    parser_cls = get_tool_parser(name)
    out = parser_cls(TOOLS).extract(reply)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == expected
    assert all(c.id.startswith("chatcmpl-tool-") for c in out.calls)
    whole = (out.content or "", [(c.name, c.arguments) for c in out.calls])
    splits = [[reply[:k], reply[k:]] for k in range(len(reply) + 1)] + [list(reply)]
    for pieces in splits:
        streamed = _streamed(parser_cls, pieces)
        if reply in MALFORMED:  # a call already sent cannot be taken back; the content still ends up whole
            assert streamed[0] == reply
            continue
        assert streamed[:2] == whole, pieces
        assert len(set(streamed[2])) == len(streamed[2])  # one id per call


def test_registry():
    assert {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "qwen3_xml"} <= set(TOOL_PARSER_NAMES)
    with pytest.raises(ValueError, match="tool_call_parser='nope' is not known: one of hermes"):
        get_tool_parser("nope")
    assert get_tool_parser("mistral").keeps_special_tokens


def test_arguments_stream_before_the_call_ends():
    """Argument fragments go out while the call is still being written (not only at its end)."""
    parser = get_tool_parser("hermes")()
    _, entries = parser.extract_delta('<tool_call>{"name": "f", "arguments": {"city": "Par')
    assert entries[0]["function"]["name"] == "f"
    assert entries[1]["function"]["arguments"] == '{"city": "Par'
