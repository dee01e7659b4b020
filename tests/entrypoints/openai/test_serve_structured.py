"""Structured outputs through the server: response_format (json_object, json_schema), the guided_* fields,
structured_outputs and guided_decoding_backend on completions and chat; the outputs obey their constraint.
(Bad constraints are in test_serve_errors.py.)"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

MODEL_NAME = "smollm2-test"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Describe Paris in JSON."}], "max_tokens": 80}
COMPLETION = {"model": MODEL_NAME, "prompt": "The weather today is", "max_tokens": 40, "temperature": 0}


def _chat_text(server, change: dict) -> str:
    status, body = server.request("POST", "/v1/chat/completions", {**CHAT, "temperature": 0, **change})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop", body
    return body["choices"][0]["message"]["content"]


def _completion_texts(server, change: dict) -> list[str]:
    status, body = server.request("POST", "/v1/completions", {**COMPLETION, **change})
    assert status == 200, body
    return [c["text"] for c in body["choices"]]


@pytest.mark.parametrize(
    "change",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}},
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "xgrammar"},
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        {"guided_json": SCHEMA, "guided_decoding_backend": "guidance", "guided_whitespace_pattern": " ?"},
        {"structured_outputs": {"json": SCHEMA, "backend": "guidance"}},
    ],
    ids=["response_format", "guided_json", "guided_json text", "structured_outputs", "guidance", "guidance field"],
)
def test_chat_json_schema(server, change):
    jsonschema.validate(json.loads(_chat_text(server, change)), SCHEMA)


def test_chat_json_object(server):
    messages = [{"role": "user", "content": "Give a JSON object with the keys name and age for Bob, 30."}]
    text = _chat_text(server, {"response_format": {"type": "json_object"}, "messages": messages})
    assert isinstance(json.loads(text), dict)


def test_completion_fields(server):
    for text in _completion_texts(
        server, {"guided_regex": r"(sunny|rainy), [0-9]{2} degrees", "n": 2, "seed": 1, "temperature": 0.8}
    ):
        assert re.fullmatch(r"(sunny|rainy), [0-9]{2} degrees", text), text
    assert _completion_texts(server, {"guided_choice": ["hot", "cold"]})[0] in ("hot", "cold")
    grammar = 'root ::= "It is " ("warm" | "cool") "."'
    assert _completion_texts(server, {"guided_grammar": grammar})[0] in ("It is warm.", "It is cool.")
    texts = _completion_texts(server, {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}})
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    text = _completion_texts(server, {"structured_outputs": {"choice": ["a", "b"]}, "guided_decoding_backend": "auto"})
    assert text[0] in ("a", "b")
    assert _completion_texts(server, {"response_format": {"type": "text"}, "max_tokens": 3})[0]


@pytest.mark.parametrize("backend", ["guidance", "auto"])
def test_completion_lark_grammar(server, backend):
    """A Lark grammar: llguidance reads it; "auto" falls back to it (xgrammar reads only EBNF). vLLM's docs' form
    (`?` rules, no `start:` line) is Lark too: a grammar without `::=` is."""
    lark = 'start: "It is " TEMP "."\nTEMP: "warm" | "cool"\n'
    change = {"guided_grammar": lark, "guided_decoding_backend": backend}
    assert _completion_texts(server, change)[0] in ("It is warm.", "It is cool.")
    inlined = '?start: sel\n?sel: "SELECT " /[a-z]{1,8}/ " FROM " /[a-z]{1,8}/'
    change = {"structured_outputs": {"grammar": inlined}, "guided_decoding_backend": backend}
    assert re.fullmatch("SELECT [a-z]{1,8} FROM [a-z]{1,8}", _completion_texts(server, change)[0])
    for regex in (r"(sunny|rainy), [0-9]{2} degrees", r"[a-z]{3}"):
        text = _completion_texts(server, {"guided_regex": regex, "guided_decoding_backend": backend})[0]
        assert re.fullmatch(regex, text), text


def test_openai_client_response_format(client):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT["messages"],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in out if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_openai_client_parse_pydantic(client):
    """The openai client's parse (response_format=PydanticModel, sent as a strict json_schema) and its streamed
    form: the reply is the model object, validated by pydantic."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=20)
        population: int = Field(ge=0)
        capital: bool

    kwargs = dict(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=80, temperature=0, response_format=City)
    parsed = client.chat.completions.parse(**kwargs).choices[0].message.parsed
    assert isinstance(parsed, City)
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0].message.parsed
    assert streamed == parsed
