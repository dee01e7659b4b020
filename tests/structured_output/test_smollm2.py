"""Structured outputs on the bundled SmolLM2 (slow tier): JSON schemas an instruct model fills for real validate
with jsonschema, and where the mask never bites the greedy tokens are the unconstrained ones."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "role": {"enum": ["engineer", "doctor", "artist", "other"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
        "address": {"$ref": "#/$defs/address"},
        "email": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}, {"type": "null"}]},
    },
    "required": ["name", "age", "height_m", "role", "skills", "address", "email"],
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        }
    },
}
PROMPTS = [
    "Describe a fictional person as JSON.",
    "Give me a JSON record for a doctor who lives in Paris.",
    "Invent an artist and describe them in JSON.",
]


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:
    return LLM(smollm2, dtype="float32", kv_cache_memory_bytes=64 << 20)


def chat(llm, params):
    return llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.7, seed=1, n=2)])
def test_person_schema_validates(llm, sampling, backend):
    if backend == "guidance":
        pytest.importorskip("llguidance")
    constraint = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True, backend=backend)
    outs = chat(llm, SamplingParams(max_tokens=250, structured_outputs=constraint, **sampling))
    for c in (c for o in outs for c in o.outputs):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


def test_choice_of_the_free_answer_is_the_free_answer(llm):
    """The free greedy answer is one of the choices: every greedy token is allowed, so the tokens are the same;
    then only EOS is allowed."""
    free = chat(llm, SamplingParams(temperature=0, max_tokens=12))
    for prompt_out, prompt in zip(free, PROMPTS):
        text = prompt_out.outputs[0].text
        params = SamplingParams(temperature=0, max_tokens=20, structured_outputs={"choice": [text, "Something else."]})
        out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids[:-1] == prompt_out.outputs[0].token_ids and out.text == text
        assert out.finish_reason == "stop"


CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "City",
        "description": "A city and its facts.",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "population": {"type": "integer", "minimum": 0},
                "capital": {"type": "boolean"},
            },
            "required": ["name", "population", "capital"],
        },
    },
}


def test_forced_tool_call_never_runs_on_whitespace(llm):
    """A named tool_choice on a prompt that asks for no tool: with unbounded JSON whitespace the model wrote
    newlines until max_tokens; compact, the call completes and parses."""
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.serving_tools import plan_tools

    server = SimpleNamespace(reasoning_parser=None, enable_auto_tools=False, tool_parser=None)
    request = SimpleNamespace(
        tools=[CITY_TOOL], tool_choice={"type": "function", "function": {"name": "City"}}, parallel_tool_calls=None
    )
    params = SamplingParams(temperature=0, max_tokens=100)
    plan = plan_tools(server, request, params)
    out = llm.chat([{"role": "user", "content": "Hi"}], params, tools=[CITY_TOOL], use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    (call,) = plan.reply(None).message(out.text)["tool_calls"]
    assert call["function"]["name"] == "City"
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY_TOOL["function"]["parameters"])
