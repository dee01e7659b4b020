"""Qwen3: the model opens `<think>` itself (or the template does, at the end of the prompt); a reply that opens no
section is all content, and with thinking turned off (`enable_thinking=False` closes the section in the prompt)
the whole reply is content."""

from pagedllm.reasoning.abs_reasoning_parser import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False
