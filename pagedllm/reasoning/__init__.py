"""Reasoning parsers: a reply's `<think>...</think>` section -> `reasoning_content`, chosen by name
(`--reasoning-parser`)."""

from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parser import ReasoningParser
from pagedllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from pagedllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} is not known: one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


def reasoning_markers(parser: type[ReasoningParser], tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids of the parser's start and end markers (what the engine watches to start a grammar)."""

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return encode(parser.start_marker), encode(parser.end_marker)


__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser", "reasoning_markers"]
