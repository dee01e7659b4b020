"""Chat conversations to prompts: validate OpenAI-style messages, render them with the chat template, tokenize.

`apply_chat_template` is what `LLM.chat` (and the OpenAI server) call: conversation + options -> (prompt text,
prompt token ids), the token ids being exactly what transformers' `tokenizer.apply_chat_template(...,
tokenize=True)` gives for the same (normalized) conversation. Messages are normalized as vLLM does: a content given
as a list of text parts becomes one string joined by newlines for templates that expect a string ("string"
format), or a list of {"type": "text", "text": ...} parts for templates that loop over parts ("openai" format)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pagedllm.entrypoints.chat_template import (
    detect_content_format,
    load_chat_template,  # noqa: F401  (vLLM imports it from here)
    render,
    resolve_chat_template,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART_TYPES = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
MULTIMODAL_PART_TYPES = (
    "image_url",
    "input_image",
    "image_pil",
    "image_embeds",
    "image",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "audio",
    "video_url",
    "video",
    "prompt_embeds",
    "file",
)
CONTENT_FORMATS = ("auto", "string", "openai")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
MAX_NESTING = 64  # how deep messages, tools and template kwargs may nest (lists and dicts); deeper is a ValueError
# chat() sets these itself; a template variable of the same name in chat_template_kwargs would be ambiguous
_RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize")


def as_conversations(messages: Any) -> list[list]:
    """One conversation (a list of message dicts) or a list of conversations -> a list of conversations."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(
            f"messages has type {type(messages).__name__}; expected a list of message dicts or a list of such lists"
        )
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    if not isinstance(messages[0], (list, tuple)):
        return [list(messages)]
    for i, conversation in enumerate(messages):
        if not isinstance(conversation, (list, tuple)):
            raise TypeError(
                f"messages[{i}] has type {type(conversation).__name__}; in a list of conversations each must be a list"
            )
    return [list(c) for c in messages]


def _multimodal_error(where: str, kind: str) -> ValueError:
    return ValueError(f"{where}: a {kind!r} part is multimodal input, which is not supported (text parts only)")


def _part_text(part: Any, where: str, media: Any = None) -> Any:
    """The text of one content part: a str, or a dict of a text type. An image or video part goes to `media` (a
    multimodal.media.ChatMedia of a model that takes them) and gives its MediaPart; without media it is an error."""
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise TypeError(f"{where} has type {type(part).__name__}; expected a str or a dict like {{'type': 'text'}}")
    kind = part.get("type")
    if kind is None:
        kind = next((k for k in MULTIMODAL_PART_TYPES if k in part), None)
        if kind is None:
            raise ValueError(f"{where}: missing 'type'; allowed types: {', '.join(TEXT_PART_TYPES)}")
    if kind in MULTIMODAL_PART_TYPES:
        if media is None:
            raise _multimodal_error(where, kind)
        return media.add(kind, part, where)  # a multimodal.media.MediaPart
    if kind not in TEXT_PART_TYPES:
        raise ValueError(f"{where}: type {kind!r} is not one of {', '.join(TEXT_PART_TYPES)}")
    key = TEXT_PART_TYPES[kind]
    text = part.get(key)
    if not isinstance(text, str):
        raise ValueError(f"{where}: a {kind!r} part needs a str {key!r}, got {type(text).__name__}")
    return text


def _content(message: Mapping, where: str, content_format: str, media: Any = None) -> str | list[dict]:
    content = message.get("content")
    if content is None:
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            raise ValueError(
                f"{where}: 'content' is missing or None (only an assistant message with tool_calls may omit it)"
            )
        texts: list[str] = []
    elif isinstance(content, str):
        texts = [content]
    elif isinstance(content, (list, tuple)):
        texts = [_part_text(part, f"{where}.content[{j}]", media) for j, part in enumerate(content)]
    else:
        raise TypeError(f"{where}.content has type {type(content).__name__}; expected a str or a list of content parts")
    if content_format == "openai":  # a media part renders as {"type": "image"} / {"type": "video"}
        return [{"type": "text", "text": t} if isinstance(t, str) else {"type": t.type} for t in texts]
    return "\n".join(t if isinstance(t, str) else t.text for t in texts)


def _tool_calls(value: Any, where: str) -> list[dict]:
    """Tool calls with their JSON `arguments` parsed into dicts, as tool-use chat templates expect (vLLM)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}.tool_calls has type {type(value).__name__}; expected a list of tool calls")
    calls = []
    for j, call in enumerate(value):
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise ValueError(f"{where}.tool_calls[{j}]: expected a dict with a 'function' dict (name, arguments)")
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                function["arguments"] = {}
            except RecursionError as e:
                raise _too_deep(f"{where}.tool_calls[{j}].function.arguments") from e
        elif not isinstance(arguments, (dict, list)):
            function["arguments"] = {}
        calls.append({**call, "function": function})
    return calls


def normalize_message(message: Any, index: int, content_format: str, media: Any = None) -> dict:
    """One validated message in the form chat templates read (vLLM's ConversationMessage)."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise TypeError(f"{where} has type {type(message).__name__}; expected a dict with 'role' and 'content'")
    role = message.get("role")
    if role is None:
        raise ValueError(f"{where}: missing 'role'; allowed roles: {', '.join(ROLES)}")
    if role not in ROLES:
        raise ValueError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _content(message, where, content_format, media)}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(message["tool_calls"], where)
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if role == "assistant" and reasoning is not None:  # under every name templates read it (as transformers)
        out.update({k: reasoning for k in _REASONING_KEYS})
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if role == "developer" and message.get("tools") is not None:
        out["tools"] = message["tools"]
    return _plain(out, where)


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """Only plain JSON data reaches a template (no objects whose methods the sandbox cannot judge), nested at most
    MAX_NESTING deep (deeper data would exhaust Python's recursion in the template)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # subclasses (enums, numpy scalars, ...) back to the base type
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, (Mapping, list, tuple)) and depth >= MAX_NESTING:
        raise _too_deep(where)
    if isinstance(value, Mapping):
        return {_plain(k, where, depth + 1): _plain(v, where, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where, depth + 1) for v in value]
    return f"<{type(value).__name__}>"


def _too_deep(where: str) -> ValueError:
    return ValueError(f"{where} is nested too deep: at most {MAX_NESTING} levels of lists and dicts are allowed")


def _check_options(content_format: str, add_generation_prompt: bool, continue_final_message: bool, tools, kwargs):
    if content_format not in CONTENT_FORMATS:
        raise ValueError(
            f"chat_template_content_format={content_format!r} is not one of {', '.join(map(repr, CONTENT_FORMATS))}"
        )
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message=True and add_generation_prompt=True cannot be combined: continuing the final "
            "message leaves it open, a generation prompt starts a new one (set add_generation_prompt=False)"
        )
    if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools)):
        raise TypeError("tools must be a list of tool dicts (JSON schemas like {'type': 'function', 'function': ...})")
    if kwargs is not None:
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"chat_template_kwargs has type {type(kwargs).__name__}; expected a dict")
        reserved = sorted(set(kwargs) & set(_RESERVED_KWARGS))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved} are set by chat() itself; pass them as arguments")


def apply_chat_template(
    tokenizer,
    conversation: list,
    *,
    chat_template: Any = None,
    chat_template_content_format: str = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    model_path: str | None = None,
    media: Any = None,
) -> tuple[str, list[int]]:
    """(prompt text, prompt token ids) of one conversation. Raises ValueError/TypeError naming a bad message.
    media: a multimodal.media.ChatMedia that takes the conversation's images (a model that takes images); without
    it an image part is a ValueError."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True gives none)")
    _check_options(
        chat_template_content_format, add_generation_prompt, continue_final_message, tools, chat_template_kwargs
    )
    if not conversation:
        raise ValueError("messages is empty: a conversation needs at least one message")
    source = resolve_chat_template(tokenizer, chat_template, tools, model_path)
    content_format = chat_template_content_format
    if content_format == "auto":
        content_format = detect_content_format(source)
    messages = [normalize_message(m, i, content_format, media) for i, m in enumerate(conversation)]
    kwargs = _plain(dict(chat_template_kwargs or {}), "chat_template_kwargs")
    template_kwargs = {**getattr(tokenizer, "special_tokens_map", {}), **kwargs}
    text = render(
        source,
        messages,
        tools=_plain(list(tools), "tools") if tools is not None else None,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
    )
    # The template writes the special tokens (BOS included) itself: the tokenizer must not add them again.
    return text, tokenizer.encode(text, add_special_tokens=False)
