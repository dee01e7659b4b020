"""The reasoning parsers: a whole reply splits into reasoning_content and content as each model family writes them
(with the prompt's own markers taken into account), and the same reply streamed, split at every character boundary
and one character at a time, joins into exactly the same two texts."""

from __future__ import annotations

import pytest

from pagedllm.reasoning import get_reasoning_parser, reasoning_markers
from pagedllm.reasoning.abs_reasoning_parser import CLOSED, NONE, OPENED, prompt_state

PLAIN = "<|user|>hi<|assistant|>"
OPENING = "<|user|>hi<|assistant|><think>\n"
CLOSING = "<|user|>hi<|assistant|><think>\n\n</think>\n\n"

# (parser, prompt, reply, reasoning, content)
CASES = [
    ("deepseek_r1", OPENING, "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", PLAIN, "<think>a < b</thin</think>yes", "a < b</thin", "yes"),
    ("deepseek_r1", PLAIN, "never closed <", "never closed <", None),
    ("deepseek_r1", CLOSING, "just the answer</think>", None, "just the answer</think>"),
    ("qwen3", PLAIN, "<think>\nhmm\n</think>\n\n42", "\nhmm\n", "\n\n42"),
    ("qwen3", PLAIN, "no thinking here </think> at all", None, "no thinking here </think> at all"),
    ("qwen3", PLAIN, "<thinker", None, "<thinker"),
    ("qwen3", OPENING, "opened by the template</think>done", "opened by the template", "done"),
    ("qwen3", CLOSING, "<think>thinking is off", None, "<think>thinking is off"),
    ("qwen3", PLAIN, "<think>cut short", "cut short", None),
]


def test_prompt_state():
    assert (prompt_state(PLAIN), prompt_state(OPENING), prompt_state(CLOSING)) == (NONE, OPENED, CLOSED)
    assert prompt_state(None) == NONE


@pytest.mark.parametrize("name,prompt,reply,reasoning,content", CASES)
def test_extract_and_stream(name, prompt, reply, reasoning, content):
    cls = get_reasoning_parser(name)
    assert cls(prompt).extract(reply) == (reasoning, content)
    splits = [[reply[:k], reply[k:]] for k in range(len(reply) + 1)] + [list(reply)]
    for pieces in splits:
        parser, got = cls(prompt), ["", ""]
        for k, piece in enumerate(pieces):
            for i, part in enumerate(parser.extract_delta(piece, final=k == len(pieces) - 1)):
                got[i] += part
        assert got == [reasoning or "", content or ""], pieces


def test_registry_and_markers():
    with pytest.raises(ValueError, match="reasoning_parser='nope' is not known: one of deepseek_r1, qwen3"):
        get_reasoning_parser("nope")

    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return [ord(c) for c in text]

    start, end = reasoning_markers(get_reasoning_parser("qwen3"), Tokenizer())
    assert start == tuple(map(ord, "<think>")) and end == tuple(map(ord, "</think>"))
