"""DeepSeek-R1: the template opens `<think>` itself, so a reply is reasoning until `</think>` (a leading `<think>`
the model writes anyway is dropped); a reply that never closes it is all reasoning."""

from pagedllm.reasoning.abs_reasoning_parser import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True
