"""The per-forward attention metadata, handed to attention layers through an explicit, non-nesting context."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_current: Any = None


@contextmanager
def forward_context(attn_metadata: Any) -> Iterator[None]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context does not nest: a forward is already running")
    _current = attn_metadata
    try:
        yield
    finally:
        _current = None


def get_attn_metadata() -> Any:
    if _current is None:
        raise RuntimeError("attention layers run only inside `with forward_context(metadata):`")
    return _current
