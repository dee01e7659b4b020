"""The request of OpenAI's Responses API (POST /v1/responses) and its translation into a chat completions request,
so that a response is rendered, sampled, constrained and parsed exactly as a chat completion is.

`input` (a string, or items: messages with role user / system / developer / assistant, `function_call` and
`function_call_output` items of a tool round trip; `reasoning` items, which a client passes back with a previous
response's output, are skipped as chat templates drop earlier reasoning) becomes `messages`, `instructions` a
system message in front; function tools and `tool_choice` take the chat shape; `text.format` becomes
`response_format`; `max_output_tokens` is `max_completion_tokens`. OpenAI's fields this server cannot honour
(`reasoning`, `background`, `include`, built-in tools, ...) are a 400 naming them."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, SamplingExtras

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")
# vLLM's extra sampling fields, passed to the chat request as they are
_EXTRAS = (
    "seed",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stop_token_ids",
    "allowed_token_ids",
    "bad_words",
    "logit_bias",
    "truncate_prompt_tokens",
    "cache_salt",
    "request_id",
    "priority",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "structured_outputs",
    "user",
    "metadata",
    "service_tier",
)
# OpenAI's fields that change the answer in ways this server does not serve: their accepted (no-op) values
_REFUSED = {
    "reasoning": (None,),
    "background": (None, False),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "prompt": (None,),
    "conversation": (None,),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "prompt_cache_key": (None,),
}


def _bad(message: str, param: str) -> APIError:
    return APIError(message, 400, param=param)


class ResponsesRequest(SamplingExtras):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = Field(default=None, examples=["Say hello."])
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # None: true, as OpenAI (kept in the server's bounded in-memory store)
    previous_response_id: str | None = None
    service_tier: str | None = None
    # OpenAI's fields refused unless they ask for nothing (see _REFUSED)
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    prompt_cache_key: str | None = None
    # (the sampling fields are SamplingExtras', as on chat completions) vLLM's other extras
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's constraint field (or text.format, not both)


def refuse_fields(req: ResponsesRequest) -> None:
    for name, accepted in _REFUSED.items():
        value = getattr(req, name)
        if value not in accepted:
            raise _bad(f"{name}={value!r} is not supported by this server's /v1/responses", name)
    if req.input is None and req.previous_response_id is None:
        raise _bad("input is required", "input")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"{where} must be a string", "input")
    return value


def _content(content: Any, where: str) -> str | list[dict]:
    """A message's content in the chat shape: a string, or parts (text; an image for a model that takes them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": _text(part.get("text"), f"{at}.text")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": _text(part.get("refusal"), f"{at}.refusal")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            message = f"{at}.type={kind!r} is not supported: 'input_text', 'output_text' or 'input_image' (a URL)"
            raise _bad(message, "input")
    return parts


def input_messages(items: str | list | None, where: str = "input") -> list[dict]:
    """`input` (or a stored response's output items) as chat messages."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{at}.role={role!r} is not one of {', '.join(_ROLES)}", "input")
            messages.append({"role": role, "content": _content(item.get("content"), at)})
        elif kind == "function_call":
            function = {"name": _text(item.get("name"), f"{at}.name")}
            function["arguments"] = _text(item.get("arguments"), f"{at}.arguments")
            call = {"id": _text(item.get("call_id"), f"{at}.call_id"), "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # calls after an assistant message join it
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                texts = [p.get("text", "") for p in output if isinstance(p, dict)]
                output = "".join(_text(t, f"{at}.output[].text") for t in texts)
            call_id = _text(item.get("call_id"), f"{at}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(output, f"{at}.output")})
        elif kind != "reasoning":
            message = f"{at}.type={kind!r} is not supported: 'message', 'function_call' or 'function_call_output'"
            raise _bad(message, "input")
    return messages


def _tools(tools: list | None) -> list | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            message = f"tools[{i}].type={kind!r}: only function tools are served here (no built-in tools)"
            raise _bad(message, "tools")
        unknown = sorted(set(tool) - set(_TOOL_KEYS))
        if unknown:
            raise _bad(f"tools[{i}].{unknown[0]} is not supported", "tools")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _bad(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': NAME}", "tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict | None) -> dict | None:
    """text.format as chat's response_format (None: plain text)."""
    if text is None:
        return None
    unknown = sorted(k for k, v in text.items() if k != "format" and v is not None)
    if unknown:
        raise _bad(f"text.{unknown[0]} is not supported", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema: a JSON schema object is required", "text")
        spec = {"name": fmt.get("name"), "schema": fmt["schema"], "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad(f"text.format.type={kind!r} is not supported: 'text', 'json_object' or 'json_schema'", "text")


def to_chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat completions request of a Responses request; `history`: the messages of the previous response's
    conversation (previous_response_id), whose instructions are not carried over (OpenAI's rule)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history + input_messages(req.input)
    if not messages:
        raise _bad("input is empty: give at least one message", "input")
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=_tools(req.tools),
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text),
        **{name: getattr(req, name) for name in _EXTRAS},
    )
