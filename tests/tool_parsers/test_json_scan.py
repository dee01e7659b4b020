"""The partial-JSON reader: for every prefix of a JSON text, canonical_prefix is a prefix of the whole value's
canonical text (json.dumps(json.loads(text), ensure_ascii=False)), and equals it for the whole text; value_end
finds the end of a value only once it is complete."""

from __future__ import annotations

import json

import pytest

from pagedllm.tool_parsers.json_scan import canonical, canonical_prefix, object_members, value_end

TEXTS = [
    '{"a": 1, "b": [true, false, null], "c": {"d": "x\\"y\\\\z"}}',
    '{ "s" : "\\ud83d\\ude00 \\u00e9 \\n\\t" ,"n":-1.50e+2 , "e" : {} , "l" : [ ] }',
    '{"k": "😀é\\/", "big": 12345678901234567890, "f": 0.1}',
    '[1, "two", {"three": [3.0]}]',
]


@pytest.mark.parametrize("text", TEXTS)
def test_prefixes_are_stable(text):
    whole = canonical(text)
    assert whole == json.dumps(json.loads(text), ensure_ascii=False)
    assert canonical_prefix(text) == whole
    grown = ""
    for k in range(len(text) + 1):
        prefix = canonical_prefix(text[:k])
        assert whole.startswith(prefix), (k, prefix)
        assert len(prefix) >= len(grown)  # never shrinks
        grown = prefix
        assert (value_end(text, 0) is not None) if k == len(text) else True
        assert value_end(text[:k], 0) is None or k == len(text)


def test_object_members():
    text = '{"name": "f", "arguments": {"x": [1, 2]}}'
    members, end = object_members(text, 0)
    assert end == len(text)
    assert {k: text[s:e] for k, (s, e) in members.items()} == {"name": '"f"', "arguments": '{"x": [1, 2]}'}
    members, end = object_members(text[:-6], 0)
    assert end is None and members["arguments"][1] is None
    with pytest.raises(ValueError):
        object_members("{1: 2}", 0)
