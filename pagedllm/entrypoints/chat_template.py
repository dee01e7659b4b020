"""Chat templates: where a model's template comes from, and rendering it in a sandboxed Jinja environment.

The environment has the filters and globals Hugging Face chat templates use (`raise_exception`, `tojson`,
`strftime_now`, `namespace`, `dict`, the `{% generation %}` tag and loop controls) and renders exactly as
transformers' `apply_chat_template` does. Templates come from model files, i.e. from strangers: they run in
jinja2's ImmutableSandboxedEnvironment, which refuses Python internals (`__class__`, ...) and mutating methods."""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

_JINJA_CHARS = "{}\n"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks the end of the message to leave open (as transformers)


def load_chat_template(chat_template: str | os.PathLike[str]) -> str:
    """The template text, given as a Jinja string or as the path of a file that holds it (vLLM's rule)."""
    if isinstance(chat_template, os.PathLike):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if not isinstance(chat_template, str):
        raise TypeError(f"chat_template has type {type(chat_template).__name__}; expected a str or a file path")
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if not any(c in chat_template for c in _JINJA_CHARS):
        raise ValueError(f"chat_template={chat_template!r} looks like a file path, but there is no such file")
    return chat_template


def resolve_chat_template(tokenizer, chat_template: Any, tools: list | None, model_path: str | None = None) -> str:
    """The given template, else the one inside the model's GGUF file, else the tokenizer's."""
    if chat_template is not None:
        return load_chat_template(chat_template)
    template = None
    if model_path is not None and model_path.endswith(".gguf"):
        from pagedllm.model_loader.gguf_loader import gguf_chat_template

        template = gguf_chat_template(model_path)
    if template is None:
        template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: "tool_use" when tools are given, else "default"
        name = "tool_use" if tools is not None and "tool_use" in template else "default"
        template = template.get(name)
    if not template:
        raise ValueError(
            "chat_template: the model has no chat template (neither its GGUF file nor its tokenizer carries one); "
            "pass chat_template= as a Jinja string or a file path"
        )
    return template


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names (no route to Python internals through attributes)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attributes on a namespace, got {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's sandbox, but an unsafe attribute fails at once instead of rendering as an empty string."""

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not valid Jinja (line {e.lineno}): {e.message}") from e


def _is_content(node: jinja2.nodes.Node) -> bool:
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"


@lru_cache(maxsize=32)
def detect_content_format(source: str) -> str:
    """The "openai" format when the template loops over a message content (a list of parts), else "string" (vLLM)."""
    try:
        ast = _environment().parse(source)
    except TemplateSyntaxError:
        return "string"
    content_names = {
        node.target.name
        for node in ast.find_all(jinja2.nodes.Assign)
        if isinstance(node.target, jinja2.nodes.Name) and _is_content(node.node)
    }
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if _is_content(it) or (isinstance(it, jinja2.nodes.Name) and it.name in content_names):
            return "openai"
    return "string"


def render(
    source: str,
    messages: list[dict],
    *,
    tools: list[dict] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any],
) -> str:
    """The rendered conversation; with continue_final_message, cut right after the last message's content."""
    template = compile_template(source)
    final_text = None
    if continue_final_message:
        if "content" not in source:
            raise ValueError("continue_final_message=True needs a chat template that writes message 'content'")
        final_text, messages = _tag_final_message(messages)
    kwargs = {"documents": None, **template_kwargs}  # transformers always passes documents
    try:
        text = template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
    except SecurityError as e:
        raise ValueError(f"chat_template: the sandbox refused an unsafe operation: {e}") from e
    except TemplateError as e:
        raise ValueError(f"chat_template: rendering failed: {e}") from e
    except RecursionError as e:  # a template that recurses over deep (but allowed) data
        raise ValueError("chat_template: rendering recursed too deep; nest messages and tools less deeply") from e
    if final_text is not None:
        text = _cut_at_tag(text, final_text)
    return text


def _tag_final_message(messages: list[dict]) -> tuple[str, list[dict]]:
    """Appends the tag to the last text of the final message (a copy), as transformers does."""
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        final_text, last["content"] = content, content + _CONTINUE_TAG
    else:
        parts = [dict(p) if isinstance(p, dict) else p for p in content or []]
        index = next((i for i in reversed(range(len(parts))) if isinstance(parts[i], dict) and "text" in parts[i]), -1)
        if index < 0:
            raise ValueError("continue_final_message=True: the final message has no text to continue")
        final_text = parts[index]["text"]
        parts[index]["text"] = final_text + _CONTINUE_TAG
        last["content"] = parts
    return final_text, messages[:-1] + [last]


def _cut_at_tag(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message=True: the chat template does not write the final message's content as given, "
            "so it cannot be left open"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space
