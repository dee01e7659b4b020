"""LangChain against the server: `ChatOpenAI(...).with_structured_output(Model)` (OpenAI's json_schema response
format, and the function-calling method) returns a validated pydantic object, and `.bind_tools([...])` with a
forced tool choice returns tool calls whose arguments validate against the tool's schema."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("langchain_openai")

from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

MODEL_NAME = "smollm2-test"


class City(BaseModel):
    """A city and its facts."""

    name: str = Field(max_length=20)
    population: int = Field(ge=0)
    capital: bool


@tool
def get_weather(city: str, unit: str) -> str:
    """The weather in a city; unit is C or F."""
    return f"sunny in {city}"


def _chat(server) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL_NAME,
        base_url=server.base_url + "/v1",
        api_key=server.api_key or "none",
        temperature=0,
        max_tokens=80,
        max_retries=0,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(server, method):
    structured = _chat(server).with_structured_output(City, method=method)
    city = structured.invoke("Describe Paris as a city record.")
    assert isinstance(city, City)
    assert len(city.name) <= 20 and city.population >= 0


def test_bind_tools(server):
    chat = _chat(server).bind_tools([get_weather], tool_choice="get_weather")
    reply = chat.invoke("What is the weather in Paris?")
    assert [call["name"] for call in reply.tool_calls] == ["get_weather"]
    schema = get_weather.args_schema.model_json_schema()
    for call in reply.tool_calls:
        jsonschema.validate(call["args"], schema)
        assert call["id"]
    required = _chat(server).bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?")
    assert [call["name"] for call in required.tool_calls] == ["get_weather"]  # "any" is sent as "required"
