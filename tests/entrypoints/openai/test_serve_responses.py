"""POST /v1/responses through the openai client: the same greedy text as /v1/chat/completions for the same
conversation (instructions as a system message, a tool round trip as tool_calls and a tool message, a previous
response's conversation), streamed events in OpenAI's order whose deltas join into the final text, text.format
json_schema (jsonschema is the oracle), forced function calls as function_call items, max_output_tokens as status
incomplete, the in-memory store (GET, DELETE, previous_response_id, store=false), refused fields as 400s naming
them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedllm.entrypoints.openai.serving_responses import ResponseStore

MODEL_NAME = "smollm2-test"
GREEDY = {"model": MODEL_NAME, "temperature": 0}
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]},
}
MESSAGE_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _chat(client, messages: list[dict], max_tokens: int) -> object:
    return client.chat.completions.create(messages=messages, max_completion_tokens=max_tokens, **GREEDY).choices[0]


def test_text_equals_chat(client):
    resp = client.responses.create(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=40, **GREEDY)
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(messages=messages, max_completion_tokens=40, **GREEDY)
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL_NAME
    assert resp.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].annotations == []
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == chat.usage.total_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    assert (resp.instructions, resp.temperature, resp.max_output_tokens) == (INSTRUCTIONS, 0, 40)
    assert resp.tools == [] and resp.tool_choice == "none" and resp.parallel_tool_calls is True
    assert resp.text.format.type == "text"


def test_input_items_and_tool_round_trip_equal_chat(client):
    """Messages as items (input_text parts, a developer message) and a function call with its output."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 25 C"},
    ]
    resp = client.responses.create(input=items, max_output_tokens=24, **GREEDY)
    tool_call = {"id": "call_1", "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": "", "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 25 C"},
    ]
    assert resp.output_text == _chat(client, messages, 24).message.content


def _events(server, body: dict) -> list[dict]:
    """The streamed events as sent (raw SSE: event names and data)."""
    status, text = server.request("POST", "/v1/responses", {**body, "stream": True})
    assert status == 200, text
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_stream_through_sdk_joins_to_the_final_text(client):
    kwargs = {"input": QUESTION, "instructions": INSTRUCTIONS, "max_output_tokens": 40, **GREEDY}
    whole = client.responses.create(**kwargs)
    if whole.status != "completed":
        pytest.skip("the greedy reply did not stop within max_output_tokens (the SDK's stream needs completed)")
    deltas, kinds = [], []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [k for k in kinds if k not in ("response.output_text.delta",)][2:-1] == MESSAGE_EVENTS
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_incomplete_events(server, client):
    body = {"input": QUESTION, "max_output_tokens": 3, **GREEDY}
    events = _events(server, body)
    kinds = [e["type"] for e in events if e["type"] != "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", *MESSAGE_EVENTS, "response.incomplete"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == text == client.responses.create(**body).output_text
    # the SDK reads the same stream
    sdk_events = list(client.responses.create(stream=True, **body))
    assert [e.type for e in sdk_events] == [e["type"] for e in events]


def test_max_output_tokens_gives_incomplete(client):
    resp = client.responses.create(input=QUESTION, max_output_tokens=2, **GREEDY)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 2 and resp.output[0].status == "incomplete"


def test_json_schema_text_format(client):
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    resp = client.responses.create(
        input="Describe Paris in JSON.", text={"format": fmt}, max_output_tokens=60, **GREEDY
    )
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"])
def test_forced_function_call(client, choice):
    resp = client.responses.create(
        input="What is the weather in Paris?", tools=[WEATHER, TIME], tool_choice=choice, max_output_tokens=60, **GREEDY
    )
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and resp.status == "completed", resp.output
    for call in calls:
        assert call.call_id and call.id.startswith("fc_")
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.name]["parameters"]
        jsonschema.validate(json.loads(call.arguments), schema)
    if isinstance(choice, dict):
        assert [c.name for c in calls] == ["get_weather"]
    assert resp.tools[0].name == "get_weather"


def test_streamed_function_call(server):
    body = {"input": "What is the weather in Paris?", "tools": [WEATHER], "max_output_tokens": 60, **GREEDY}
    events = _events(server, {**body, "tool_choice": {"type": "function", "name": "get_weather"}})
    kinds = [e["type"] for e in events if e["type"] != "response.function_call_arguments.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    joined = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = events[-3]
    assert done["arguments"] == joined and done["name"] == "get_weather"
    jsonschema.validate(json.loads(joined), WEATHER["parameters"])
    assert events[-1]["response"]["output"] == [events[-2]["item"]]


def test_store_retrieve_previous_response_and_delete(client):
    first = client.responses.create(input=QUESTION, max_output_tokens=16, metadata={"k": "v"}, **GREEDY)
    assert first.store is True and first.metadata == {"k": "v"}
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(
        input="And of Italy?", previous_response_id=first.id, instructions="Be brief.", max_output_tokens=16, **GREEDY
    )
    assert second.previous_response_id == first.id
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ]
    assert second.output_text == _chat(client, messages, 16).message.content
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(input="Hi", previous_response_id=first.id, max_output_tokens=4, **GREEDY)
    assert info.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(input=QUESTION, store=False, max_output_tokens=4, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    named = client.responses.create(input="Hi", max_output_tokens=2, extra_body={"request_id": "mine"}, **GREEDY)
    assert named.store is True and named.id != "resp_mine"  # a stored response's id is random: never guessed


def test_a_server_without_the_store_refuses_what_needs_it():
    """VLLM_ENABLE_RESPONSES_API_STORE unset (vLLM's default): nothing is kept; store=true and
    previous_response_id are 400s naming the field, and the default (store unset) keeps nothing."""
    from pagedllm.entrypoints.openai.protocol import APIError
    from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_responses import check_store

    off, on = ResponseStore(enabled=False), ResponseStore(enabled=True)
    assert check_store(off, ResponsesRequest(input="x")) is False and check_store(on, ResponsesRequest(input="x"))
    assert check_store(on, ResponsesRequest(input="x", store=False)) is False
    for fields, param in (({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id")):
        with pytest.raises(APIError, match=f"{param}: this server keeps no responses") as info:
            check_store(off, ResponsesRequest(input="x", **fields))
        assert info.value.param == param


@pytest.mark.parametrize(
    "change,param",
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
        ({"input": None}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"text": 3}]}]}, "input"),  # was a 500
        ({"n": 2}, "n"),
        ({"previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text"),
    ],
)
def test_refused_fields_are_400_naming_them(server, change, param):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4, **change}
    status, out = server.request("POST", "/v1/responses", body)
    assert status == 400, out
    assert out["error"]["param"] == param, out
    assert out["error"]["type"] == "invalid_request_error"
    if param in change and param not in ("input", "text", "previous_response_id"):
        assert param in out["error"]["message"]


def test_unknown_response_is_404(server):
    status, out = server.request("GET", "/v1/responses/resp_nope")
    assert status == 404 and out["error"]["type"] == "not_found_error"


def test_store_is_bounded():
    store = ResponseStore(max_responses=2, max_chars=10_000)
    for i in range(3):
        store.put({"id": f"r{i}", "output": []}, [{"role": "user", "content": "x"}])
    assert store.get("r0") is None and store.get("r1") is not None and store.get("r2") is not None
    store.put({"id": "big", "output": [], "pad": "y" * 20_000}, [])
    assert store.get("big") is None and store.get("r2") is None  # over the character budget: all dropped
    assert store.delete("r1") is False


def _plain(items: list[dict]) -> list[dict]:
    """Output items without their random ids."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_reasoning_and_auto_calls_whole_and_streamed(tool_server):
    """The tool server's parsers: hermes calls read from an "auto" reply (forced by a choice grammar) become
    function_call items after the message; an unclosed <think> becomes a reasoning item. Streamed: the same items."""
    reply = (
        'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    auto = {"structured_outputs": {"choice": [reply]}, "tools": [WEATHER, TIME], "tool_choice": "auto", **no_thinking}
    for change in (auto, {}):
        body = {"input": "What is the weather in Oslo?", "max_output_tokens": 80 if change else 12, **GREEDY, **change}
        status, whole = tool_server.request("POST", "/v1/responses", body)
        assert status == 200, whole
        streamed = _events(tool_server, body)[-1]["response"]
        assert _plain(streamed["output"]) == _plain(whole["output"])
        kinds = [item["type"] for item in whole["output"]]
        if change:
            assert kinds == ["message", "function_call", "function_call"] and whole["status"] == "completed"
            assert whole["output"][0]["content"][0]["text"] == "Checking."
            assert json.loads(whole["output"][2]["arguments"]) == {"zone": "UTC"}
        else:
            assert kinds == ["reasoning", "message"] and whole["status"] == "incomplete"
            assert whole["output"][0]["content"][0]["text"] and whole["output"][1]["content"][0]["text"] == ""
