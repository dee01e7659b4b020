"""Reading JSON that may still be arriving: where a value ends (None while it is incomplete), the members of an
object, and the canonical text (`json.dumps(value, ensure_ascii=False)`) of as much of a value as is certain, so
streamed argument fragments join into exactly the arguments a complete parse gives."""

from __future__ import annotations

import json

_WHITESPACE = " \t\n\r"
_SCALAR_END = _WHITESPACE + ",]}:"  # what ends a number or a literal (true, false, null)


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> int | None:
    """The index after the string that starts at text[pos] == '"', None if it is not closed yet."""
    i = pos + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, pos: int) -> int | None:
    """The index after the JSON value that starts at text[pos] (no leading whitespace), None while incomplete.
    Only the nesting and the strings are checked: json.loads judges the value once it is whole."""
    if pos >= len(text):
        return None
    if text[pos] == '"':
        return string_end(text, pos)
    if text[pos] not in "[{":
        i = pos
        while i < len(text) and text[i] not in _SCALAR_END:
            i += 1
        return i if i < len(text) else None  # a scalar at the very end may still grow
    depth, i = 0, pos
    while i < len(text):
        ch = text[i]
        if ch == '"':
            end = string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def object_members(text: str, pos: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the object at text[pos] == '{': key -> (value start, value end or None), and the index after
    the object (None while incomplete). Raises ValueError where the text is not an object's shape."""
    members: dict[str, tuple[int, int | None]] = {}
    i = skip_ws(text, pos + 1)
    while i < len(text):
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            raise ValueError(f"expected a key at {i}")
        key_end = string_end(text, i)
        if key_end is None:
            return members, None
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return members, None
        if text[i] != ":":
            raise ValueError(f"expected ':' at {i}")
        start = skip_ws(text, i + 1)
        end = value_end(text, start)
        members[key] = (start, end)
        if end is None:
            return members, None
        i = skip_ws(text, end)
    return members, None


def canonical(raw: str) -> str:
    """A whole JSON value as compact canonical text (raises ValueError if it is not JSON)."""
    return json.dumps(json.loads(raw), ensure_ascii=False)


def canonical_prefix(raw: str) -> str:
    """The canonical text of the JSON value that `raw` begins, as far as it is certain: structural characters and
    closed escapes at once, numbers and literals once something ends them. For a whole value this equals
    canonical(raw) but for a number or literal standing alone at the end, which stays out."""
    out: list[str] = []
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch in _WHITESPACE:
            i += 1
        elif ch in "{}[]":
            out.append(ch)
            i += 1
        elif ch in ",:":
            out.append(ch + " ")
            i += 1
        elif ch == '"':
            i = _string_prefix(raw, i, out)
            if i < 0:
                break
        else:
            j = i
            while j < len(raw) and raw[j] not in _SCALAR_END:
                j += 1
            if j == len(raw):
                break
            out.append(canonical(raw[i:j]))
            i = j
    return "".join(out)


def _string_prefix(raw: str, pos: int, out: list[str]) -> int:
    """Appends the canonical text of the string at raw[pos] (as far as its characters are whole); returns the index
    after it, or -1 if it is not closed."""
    out.append('"')
    i = pos + 1
    while i < len(raw):
        ch = raw[i]
        if ch == '"':
            out.append('"')
            return i + 1
        if ch != "\\":
            out.append(json.dumps(ch, ensure_ascii=False)[1:-1])
            i += 1
            continue
        size = _escape_size(raw, i)
        if size is None:
            return -1
        out.append(json.dumps(json.loads('"' + raw[i : i + size] + '"'), ensure_ascii=False)[1:-1])
        i += size
    return -1


def _escape_size(raw: str, pos: int) -> int | None:
    """Characters of the escape at raw[pos] == '\\' (a surrogate pair counts as one), None if not whole yet."""
    if pos + 1 >= len(raw):
        return None
    if raw[pos + 1] != "u":
        return 2
    if pos + 6 > len(raw):
        return None
    if 0xD800 <= int(raw[pos + 2 : pos + 6], 16) < 0xDC00:  # a high surrogate: a low half may follow
        follow = raw[pos + 6 : pos + 12]
        if len(follow) < 6 and "\\u".startswith(follow[:2]):
            return None
        return 12 if follow.startswith("\\u") else 6
    return 6
