"""ReasoningParser: splits a reply into its reasoning (`<think>...</think>`) and its content, whole (`extract`) or
while it streams (`extract_delta`), so the streamed pieces join into exactly what `extract` gives.

Where the reasoning starts depends on the prompt too: a template may open the section itself (`<think>\\n` at the
end of the prompt) or close it (`<think>\\n\\n</think>` when thinking is off). `prompt_state` reads that."""

from __future__ import annotations

from pagedllm.tool_parsers.abstract_tool_parser import held_prefix

START, END = "<think>", "</think>"
OPENED, CLOSED, NONE = "opened", "closed", "none"


def prompt_state(prompt: str | None) -> str:
    """OPENED: the prompt's last reasoning marker opens a section; CLOSED: it ends one; NONE: neither is there."""
    prompt = prompt or ""
    start, end = prompt.rfind(START), prompt.rfind(END)
    if start < 0 and end < 0:
        return NONE
    return CLOSED if end > start else OPENED


class ReasoningParser:
    """One instance per reply (it keeps the streaming state)."""

    start_marker, end_marker = START, END
    starts_in_reasoning = False  # a reply that does not open a section is still reasoning until the end marker

    def __init__(self, prompt: str | None = None) -> None:
        self.state = prompt_state(prompt)
        self.text = ""
        self.sent = [0, 0]  # characters of reasoning and content sent

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content); while streaming only what later text cannot change."""
        if self.state == CLOSED:
            return None, text
        body, opened = text, self.state == OPENED or self.starts_in_reasoning
        if text.startswith(self.start_marker):
            body, opened = text[len(self.start_marker) :], True
        elif not final and self.start_marker.startswith(text):  # the reply may still open a section
            return "", ""
        if not opened:
            return None, text
        reasoning, sep, content = body.partition(self.end_marker)
        if not sep and not final:
            reasoning = reasoning[: len(reasoning) - held_prefix(reasoning, self.end_marker)]
        return reasoning, content

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole reply, each None where empty."""
        reasoning, content = self.split(text, final=True)
        return reasoning or None, content or None

    def extract_delta(self, delta_text: str, final: bool = False) -> tuple[str, str]:
        """The next piece of a streamed reply: (new reasoning, new content)."""
        self.text += delta_text
        reasoning, content = self.split(self.text, final)
        pieces = []
        for k, part in enumerate((reasoning or "", content)):
            pieces.append(part[self.sent[k] :] if len(part) > self.sent[k] else "")
            self.sent[k] = max(self.sent[k], len(part))
        return pieces[0], pieces[1]
