"""Checks of a raw JSON request body before the app parses it: nesting deeper than MAX_JSON_DEPTH (in the body or
in a tool call's `arguments` string, which the chat template parses) and lone UTF-16 surrogates ("\\ud800", valid
JSON but not Unicode text: they cannot be tokenized nor written back in an answer). Both are refused with a 400
instead of a RecursionError or UnicodeEncodeError deep inside the server.

A body with few brackets and no surrogate escape (almost every request) passes after two byte scans; only the rest
is parsed and walked, iteratively (the walk itself never recurses)."""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.limits import MAX_JSON_DEPTH

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BodyError(ValueError):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _too_deep(where: str | None) -> BodyError:
    field = where.split(".")[0] if where else None
    return BodyError(
        f"{field or 'the request body'} is nested more than {MAX_JSON_DEPTH} levels deep (at most {MAX_JSON_DEPTH} "
        "levels of arrays and objects are allowed)",
        field,
    )


def check_body(body: bytes) -> None:
    """Raises BodyError for a body nested too deep or holding a lone surrogate; a body that is not JSON passes (the
    app answers it)."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH and not _SURROGATE_ESCAPE.search(body):
        return
    try:
        value = json.loads(body)
    except RecursionError:
        raise _too_deep(None) from None
    except ValueError:
        return
    _walk(value, "")


def _path(parent: str, key: object) -> str:
    return f"{parent}.{key}" if parent else str(key)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BodyError(
            f"{where or 'the request body'} holds a lone UTF-16 surrogate ({text[e.start]!a} at character {e.start}): "
            "text must be valid Unicode",
            where.split(".")[0] or None,
        ) from None


def _walk(value: object, root: str) -> None:
    stack = [(value, root, 0)]  # (value, dotted path, depth)
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, where)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _too_deep(where)
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in pairs:
            if isinstance(key, str):
                _check_text(key, where)
            path = _path(where, key)
            if key == "arguments" and isinstance(child, str) and child.count("[") + child.count("{") > MAX_JSON_DEPTH:
                _check_arguments(child, path)
            stack.append((child, path, depth + 1))


def _check_arguments(text: str, where: str) -> None:
    """A tool call's arguments: a JSON text that the chat template parses and renders, so its own nesting counts."""
    try:
        parsed = json.loads(text)
    except RecursionError:
        raise _too_deep(where) from None
    except ValueError:
        return
    _walk(parsed, where)
