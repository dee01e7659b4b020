"""The per-forward attention metadata, handed to attention layers through an explicit, non-nesting context; with
LoRA, the step's adapter mapping (which tokens use which adapter slot) for the linear layers too."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_current: Any = None
_lora_mapping: Any = None


@contextmanager
def forward_context(attn_metadata: Any, lora_mapping: Any = None) -> Iterator[None]:
    global _current, _lora_mapping
    if _current is not None:
        raise RuntimeError("forward_context does not nest: a forward is already running")
    _current, _lora_mapping = attn_metadata, lora_mapping
    try:
        yield
    finally:
        _current = _lora_mapping = None


def get_lora_mapping() -> Any:
    """The step's LoRAMapping (lora/mapping.py); None: every token runs the base model."""
    return _lora_mapping


def get_attn_metadata() -> Any:
    if _current is None:
        raise RuntimeError("attention layers run only inside `with forward_context(metadata):`")
    return _current
